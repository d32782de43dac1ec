"""Once a process has loaded its models, what is alive then is kept out of the cyclic collector's full passes."""

from __future__ import annotations

import gc


def freeze_loaded_objects() -> None:
    """Once a process has loaded its models: collect, then move every object still alive (the imported libraries'
    modules, functions and classes, the models' and tokenizers' Python side: ~180,000 objects with the default model)
    into the collector's permanent generation (gc.freeze), which its collections no longer walk.

    Why: they live as long as the process, yet each full collection would walk them all, ~0.1 s holding the GIL, and
    every stream stalls meanwhile (the engine thread needs the GIL between its C calls). A long-running server reaches
    full collections as its requests' longer-lived objects pile up. Objects made later are collected as before: the
    collector is turned back on here where a start turned it off while loading (start.serve_forever)."""
    gc.collect()
    gc.freeze()
    gc.enable()
