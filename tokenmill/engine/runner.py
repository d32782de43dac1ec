"""ModelRunner: scheduled sequences → input ids, positions and attention metadata → model → hidden states and logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tokenmill.engine.kv_cache import allocate_kv_tensors
from tokenmill.engine.scheduler import Scheduled
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.causal_lm import CausalLM, HeadSummary
from tokenmill.model.model_config import ModelConfig


class ModelRunner:
    def __init__(
        self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str = "auto"
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_tensors(cfg, num_blocks, block_size, self.dtype, kv_dtype)
        self.head: tuple[torch.Tensor, HeadSummary | None] | None = None  # see forward
        self._block_slots = torch.arange(num_blocks * block_size).view(num_blocks, block_size)  # block → its slots
        self._slots_of: tuple[list[int], torch.Tensor] = ([], torch.empty(0, dtype=torch.int64))  # the last lookup

    def forward(self, batch: Seq[Scheduled], greedy_keep: list[int] | None = None) -> torch.Tensor:
        """Runs the step's tokens through the model; returns final hidden states (T, hidden), batch order.

        `greedy_keep`: the step's last row will be sampled alone and greedily, reading only its argmax and these
        ids' logits (sample_step.greedy_keep). Its head may then run in the same call as the layers: its logits and
        summary are left in `head` (else None), as logits_summarised(that row, greedy_keep) would give them. Both
        hold until the next forward (CausalLM.forward_step, which enters torch's inference mode where it needs it)."""
        input_ids, positions, meta = self.prepare(batch)
        adapters = self.model.adapters
        if adapters is None:
            hidden, self.head = self.model.forward_step(input_ids, positions, self.kv_caches, meta, greedy_keep)
            return hidden
        adapters.rows.set((s.seq.adapter.slot if s.seq.adapter else None, s.num_tokens) for s in batch)
        try:
            hidden, self.head = self.model.forward_step(input_ids, positions, self.kv_caches, meta, greedy_keep)
        finally:
            adapters.rows.clear()
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) → float32 logits (N, V)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def logits_summarised(
        self, hidden: torch.Tensor, keep: list[int] | None = None
    ) -> tuple[torch.Tensor, HeadSummary | None]:
        """logits, with each row's argmax and finiteness where the head's own pass found them (a GGUF head); `keep`:
        a lone greedy row's, as CausalLM.compute_logits_summarised takes it."""
        return self.model.compute_logits_summarised(hidden, keep)

    def prepare(self, batch: Seq[Scheduled]) -> tuple[list[int], list[int], AttentionMetadata]:
        """The step's token ids, their positions and the attention's metadata. Plain lists where they can be, and
        one tensor, every context slot, which a lone sequence's decode steps reuse until its blocks change: after a
        step has streamed the weights through the caches, each torch call here would find its code cold."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        new_slots: list[int] = []  # the cache slot of each new token
        context_lens: list[int] = []
        blocks: list[int] = []  # each sequence's blocks that hold its context, back to back
        starts: list[int] = []  # where each sequence's slots begin among all of them
        for s in batch:
            seq = s.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_tokens
            table = seq.block_table
            ids.extend(seq.token_ids[start : end - len(s.draft)])
            ids.extend(s.draft)  # guessed tokens (speculation.py), scored in the same pass
            pos.extend(range(start, end))
            new_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            starts.append(len(blocks) * bs)
            blocks.extend(table[: -(-end // bs)])
        if blocks != self._slots_of[0]:  # every sequence's cache slots, block by block, in one lookup
            self._slots_of = (blocks, self._block_slots[blocks].view(-1))
        meta = AttentionMetadata(
            new_slots=new_slots,
            query_lens=[s.num_tokens for s in batch],
            context_lens=context_lens,
            slots=self._slots_of[1],
            starts=starts,
        )
        return ids, pos, meta

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (a forked sequence's private copy of a shared partial block)."""
        a, b = src * self.block_size, dst * self.block_size
        for k_cache, v_cache in self.kv_caches:
            k_cache[b : b + self.block_size] = k_cache[a : a + self.block_size]
            v_cache[b : b + self.block_size] = v_cache[a : a + self.block_size]
