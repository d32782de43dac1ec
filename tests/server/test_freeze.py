"""What a server does with the objects loading left (server/freeze.py): frozen out of the collector's passes."""

from __future__ import annotations

import gc
import weakref

from tokenmill.server.freeze import freeze_loaded_objects


def test_freezing_after_loading_keeps_live_objects_out_of_collections_and_collects_garbage_first() -> None:
    class Node:
        other: object = None

    alive, garbage = Node(), Node()
    garbage.other = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    try:
        freeze_loaded_objects()
        assert dead() is None  # collected first, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # in no generation a collection walks
    finally:
        gc.unfreeze()


def test_the_collector_a_start_turned_off_while_loading_is_on_again_once_the_objects_are_frozen() -> None:
    gc.disable()  # as start.serve_forever does before the imports and the load
    try:
        freeze_loaded_objects()
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
