"""ModelRunner.prepare: the step's ids, positions and cache slots, from the scheduled sequences."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.engine.runner import ModelRunner


def scheduled(context: int, new: int, first_block: int, draft: int = 0) -> SimpleNamespace:
    """A sequence of `context` tokens whose last `new` are computed in this step, its blocks numbered from
    first_block in reverse (slots must follow the table, not the numbering); `draft` guessed tokens after them, the
    ids its tokens would have (100 + position)."""
    blocks = [first_block + 9 - b for b in range(-(-(context + draft) // 4) + 1)]  # one block more than needed
    seq = SimpleNamespace(
        num_computed_tokens=context - new, token_ids=list(range(100, 100 + context)), block_table=blocks
    )
    return SimpleNamespace(seq=seq, num_tokens=new + draft, draft=list(range(100 + context, 100 + context + draft)))


def test_each_position_gets_the_slot_its_block_table_gives_it() -> None:
    runner = ModelRunner.__new__(ModelRunner)  # prepare needs the block size alone
    runner.block_size, runner._block_slots = 4, torch.arange(100 * 4).view(100, 4)
    runner._slots_of = ([], torch.empty(0, dtype=torch.int64))
    # decodes, prefills, a decode with a draft of 3
    batch = [scheduled(9, 1, 0), scheduled(6, 6, 20), scheduled(4, 1, 40), scheduled(13, 5, 60), scheduled(7, 1, 80, 3)]
    ids, pos, meta = runner.prepare(batch)  # type: ignore[arg-type]
    expected_pos = [
        p for s in batch for p in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_tokens)
    ]
    assert pos == expected_pos
    assert ids == [100 + p for p in expected_pos]
    for s, slots, context in zip(batch, meta.kv_slots, meta.context_lens):
        table = s.seq.block_table
        assert context == s.seq.num_computed_tokens + s.num_tokens
        assert slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(context)]
    starts = [s.seq.num_computed_tokens for s in batch]
    assert meta.slot_mapping.tolist() == [
        int(slots[p])
        for slots, start, context in zip(meta.kv_slots, starts, meta.context_lens)
        for p in range(start, context)
    ]
    assert meta.query_lens == [1, 6, 1, 5, 4]
