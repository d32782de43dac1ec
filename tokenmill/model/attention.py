"""Attention over the paged KV cache, computed so that a query row's numbers never depend on its neighbours.

bf16 on a CPU with AVX-512 or AVX2: one C call per layer (paged_attention.c) takes every row of the step with its list of
visible cache slots (KeyLists) and computes each (row, head) by itself, from fixed loops.

Otherwise (float32, other CPUs), in torch: a row's keys are split into chunks of CHUNK positions that start at
absolute multiples of CHUNK. Every chunk is scored and weighted with the same fixed-shape float32 matmuls, masked
positions become exact zeros, and the chunks' partial sums are added strictly in position order (a cumulative sum).

Either way a row gets the same bits whether it is decoded alone, decoded beside fifteen other sequences (one call for
all rows of a step), or computed inside a prompt's prefill, from a cached prefix or after a preemption.

Why not one SDPA call per sequence: its fixed per-call cost (GQA expansion, the math fallback on a CPU) is paid per
sequence and layer, so it grows with the batch, where one call per layer does not
(docs/decisions/0014-attention-key-chunks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.kernels import ops

CHUNK = 64  # keys per chunk
ROW_TILE = 4  # fp32 query rows padded to whole tiles of 4: at these shapes (head_dim x CHUNK keys) row results were
# checked not to depend on the row or batch count (MKL picks kernels by shape; see linear.py for shapes where they do)
PREFILL_BYTES = 64 << 20  # bound on one prefill call's partial outputs; longer prompts are split into row slices


@dataclass
class RowBatch:
    """B key sets, each with M query rows: the step-wide batch of decode rows (M = 1) or one prefilling sequence."""

    rows: torch.Tensor  # (B * M,) positions of the query rows in the step's flat token order
    key_slots: torch.Tensor  # (B, n * CHUNK) cache slots, from an aligned start; padding repeats a real slot
    visible: torch.Tensor  # (B, 1, n, M, CHUNK) bool: which keys each row sees
    num_rows: int  # M
    _hidden: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def hidden(self, group: int) -> torch.Tensor:
        """(B, 1, n, R, CHUNK) bool, True where a key is NOT visible; R = M × group query heads, padded to whole
        tiles (padding rows see every key). Built once per step and shared by every layer of this window."""
        if group not in self._hidden:
            b, _, n, m, _ = self.visible.shape
            hidden = (~self.visible)[..., None, :].expand(b, 1, n, m, group, CHUNK).reshape(b, 1, n, m * group, CHUNK)
            if (m * group) % ROW_TILE:
                pad = hidden.new_zeros(b, 1, n, ROW_TILE - (m * group) % ROW_TILE, CHUNK)
                hidden = torch.cat([hidden, pad], dim=3)
            self._hidden[group] = hidden
        return self._hidden[group]


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the flat batch and in the paged cache. Built by the runner, read by attention.

    The step's T tokens are laid out sequence after sequence; sequence i owns `query_lens[i]` of them, which are the
    last positions of its `context_lens[i]`-long context. The cache slot of every position of that context lies in
    `slots` from `starts[i]` on (its block table expanded, whole blocks: slots past the context follow it). The row
    batches and key lists depend only on these and on the layer's window, so they are built once per step and window
    and shared by all layers of that kind.
    """

    new_slots: list[int]  # (T,) the cache slot each new token's K/V is written to
    query_lens: list[int]
    context_lens: list[int]
    slots: torch.Tensor  # every sequence's context slots, sequence after sequence
    starts: list[int]  # where each sequence's begin in `slots`
    _slot_mapping: torch.Tensor | None = field(default=None, repr=False)
    _plans: dict[int | None, list[RowBatch]] = field(default_factory=dict, repr=False)
    _key_lists: dict[int | None, KeyLists] = field(default_factory=dict, repr=False)

    @classmethod
    def from_kv_slots(
        cls, slot_mapping: torch.Tensor, query_lens: list[int], context_lens: list[int], kv_slots: list[torch.Tensor]
    ) -> AttentionMetadata:
        """From each sequence's (context_len,) slots, as separate tensors."""
        starts = [0]
        for ctx_len in context_lens[:-1]:
            starts.append(starts[-1] + ctx_len)
        slots = kv_slots[0] if len(kv_slots) == 1 else torch.cat(kv_slots)
        return cls(slot_mapping.tolist(), query_lens, context_lens, slots, starts)

    @property
    def slot_mapping(self) -> torch.Tensor:
        """`new_slots` as a (T,) int64 tensor, made on first use (the one-call step reads the list)."""
        if self._slot_mapping is None:
            self._slot_mapping = torch.tensor(self.new_slots, dtype=torch.int64)
        return self._slot_mapping

    @property
    def kv_slots(self) -> list[torch.Tensor]:
        """Per sequence, its (context_len,) slots: views of `slots`."""
        return [self.slots[at : at + ctx_len] for at, ctx_len in zip(self.starts, self.context_lens)]

    def key_lists(self, window: int | None) -> KeyLists:
        """Each query row's visible keys as a slice of one flat slot list (the C kernel's input), per window."""
        if window not in self._key_lists:
            self._key_lists[window] = plan_key_lists(self, window)
        return self._key_lists[window]

    def row_batches(self, window: int | None, row_width: int) -> list[RowBatch]:
        """row_width: query heads × head_dim, which bounds the size of a prefill call's partial outputs."""
        if window not in self._plans:
            self._plans[window] = plan_row_batches(self, window, row_width)
        return self._plans[window]


@dataclass
class KeyLists:
    """Row r of the step sees the cache slots slots[offset[r] : offset[r] + count[r]], in position order."""

    slots: torch.Tensor  # every sequence's slots, sequence after sequence (AttentionMetadata.slots)
    offset: torch.Tensor  # (T,)
    count: torch.Tensor  # (T,)

    def astuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.slots, self.offset, self.count


def plan_key_lists(meta: AttentionMetadata, window: int | None) -> KeyLists:
    offset, count = key_list_bounds(meta, window)
    return KeyLists(meta.slots, torch.tensor(offset), torch.tensor(count))


def key_list_bounds(meta: AttentionMetadata, window: int | None) -> tuple[list[int], list[int]]:
    """Each query row's first visible slot in `meta.slots` and how many it sees, as KeyLists holds them."""
    offset: list[int] = []
    count: list[int] = []
    for q_len, ctx_len, base in zip(meta.query_lens, meta.context_lens, meta.starts):
        for end in range(ctx_len - q_len + 1, ctx_len + 1):  # the row at position end - 1 sees [lo, end)
            lo = max(0, end - window) if window is not None else 0
            offset.append(base + lo)
            count.append(end - lo)
    return offset, count


def plan_row_batches(meta: AttentionMetadata, window: int | None, row_width: int) -> list[RowBatch]:
    decode: list[tuple[int, torch.Tensor, int, int, int]] = []  # (row, slots, base, lo, end) per single-row sequence
    batches: list[RowBatch] = []
    start = 0
    for q_len, ctx_len, slots in zip(meta.query_lens, meta.context_lens, meta.kv_slots):
        first = ctx_len - q_len  # position of the sequence's first query row; row i sees positions before first+i+1
        lo = max(0, first + 1 - window) if window is not None else 0  # the first row's first visible key
        base = lo // CHUNK * CHUNK  # keys gathered from here, aligned so chunks sit at the same positions
        if q_len == 1:
            decode.append((start, slots, base, lo, ctx_len))
        else:
            ends = torch.arange(first + 1, ctx_len + 1)
            los = (ends - window).clamp(min=0) if window is not None else torch.zeros_like(ends)
            batches.extend(_prefill_batches(start, slots[base:ctx_len], los - base, ends - base, row_width))
        start += q_len
    if decode:
        batches.append(_decode_batch(decode))
    return batches


def _decode_batch(decode: list[tuple[int, torch.Tensor, int, int, int]]) -> RowBatch:
    width = max(_padded(end - base) for _, _, base, _, end in decode)
    key_slots = torch.empty(len(decode), width, dtype=torch.long)
    for i, (_, slots, base, _, end) in enumerate(decode):
        key_slots[i, : end - base] = slots[base:end]
        key_slots[i, end - base :] = slots[end - 1]
    lo = torch.tensor([[lo - base] for _, _, base, lo, _ in decode])
    hi = torch.tensor([[end - base] for _, _, base, _, end in decode])
    rows = torch.tensor([row for row, *_ in decode])
    return RowBatch(rows, key_slots, _visibility(lo, hi, width), 1)


def _prefill_batches(
    start: int, slots: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row_width: int
) -> list[RowBatch]:
    """One sequence's rows, in slices small enough that the per-chunk partial outputs stay under PREFILL_BYTES."""
    width = _padded(len(slots))
    key_slots = torch.cat([slots, slots[-1:].expand(width - len(slots))])[None]  # (1, width)
    step = max(1, PREFILL_BYTES // ((width // CHUNK) * row_width * 4))  # a row's float32 partial output per chunk
    out = []
    for a in range(0, len(lo), step):
        b = min(a + step, len(lo))
        visible = _visibility(lo[None, a:b], hi[None, a:b], width)
        out.append(RowBatch(torch.arange(start + a, start + b), key_slots, visible, b - a))
    return out


def _padded(length: int) -> int:
    return -(-length // CHUNK) * CHUNK


def _visibility(lo: torch.Tensor, hi: torch.Tensor, width: int) -> torch.Tensor:
    """lo, hi: (B, M) → (B, 1, n, M, CHUNK) bool, True where lo <= key position < hi."""
    pos = torch.arange(width)
    seen = (pos >= lo[..., None]) & (pos < hi[..., None])  # (B, M, width)
    b, m = lo.shape
    return seen.view(b, m, width // CHUNK, CHUNK).transpose(1, 2)[:, None]


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (num_slots, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query row over its own visible cached keys.
    `softcap`: Gemma 2's scores, softcap * tanh(score / softcap), before the softmax."""
    k_cache, v_cache = kv_cache
    if k_cache.dtype == torch.int8:  # an 8-bit cache: each row's codes and scale
        k, v = quantize_kv(k), quantize_kv(v)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    t, hq, d = q.shape
    if ops.usable(q) and d % 16 == 0 and d <= ops.MAX_ATTENTION_HEAD_DIM and ops.paged_attention_available():
        keys = meta.key_lists(window)
        return ops.paged_attention(q, k_cache, v_cache, keys.slots, keys.offset, keys.count, scale, softcap)
    batches = meta.row_batches(window, hq * d)
    if len(batches) == 1 and len(batches[0].rows) == t:  # one batch holds every row, in order (a pure decode step)
        return _attend(q, k_cache, v_cache, batches[0], scale, softcap).reshape(t, hq, d).to(q.dtype)
    out = torch.empty_like(q)
    for batch in batches:
        o = _attend(q.index_select(0, batch.rows), k_cache, v_cache, batch, scale, softcap)
        out.index_copy_(0, batch.rows, o.reshape(-1, hq, d).to(q.dtype))
    return out


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: RowBatch, scale: float, softcap: float | None
) -> torch.Tensor:
    hkv, (_, hq, d) = k_cache.shape[1], q.shape
    rows = q.view(-1, batch.num_rows, hkv, hq // hkv, d)  # (B, M, Hkv, G, D)
    slots = batch.key_slots.view(-1)  # index_select copies whole rows; fancy indexing goes element by element
    keys = dequantize_kv(k_cache.index_select(0, slots)).view(*batch.key_slots.shape, hkv, d)
    values = dequantize_kv(v_cache.index_select(0, slots)).view(*batch.key_slots.shape, hkv, d)
    return attend_rows(rows, keys, values, batch.hidden(hq // hkv), scale, softcap)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """(..., D) keys or values → (..., D + 2 D / 32) int8 rows of an 8-bit cache, as llama.cpp's q8_0: per block of 32
    values, scale = max |x| / 127 as float16, codes x / scale rounded to nearest even (0 where the scale is 0); the
    codes, then the scales' bytes. The C kernel's kv_quantize_rows where it is built (bf16), else the same arithmetic
    in torch: the same codes."""
    if ops.usable(x) and ops.paged_attention_available():
        return ops.kv_quantize_rows(x)
    *lead, d = x.shape
    blocks = x.float().reshape(*lead, d // ops.KV_INT8_BLOCK, ops.KV_INT8_BLOCK)
    half = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)  # (..., D / 32, 1)
    scale = half.float()
    codes = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks)).clamp_(-127, 127)
    return torch.cat([codes.reshape(*lead, d).to(torch.int8), half.reshape(*lead, -1).view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache's rows (..., D + 2 D / 32) → (..., D) float32, codes times their block's scale; other rows as
    they are."""
    if rows.dtype != torch.int8:
        return rows
    *lead, width = rows.shape
    d = width * ops.KV_INT8_BLOCK // (ops.KV_INT8_BLOCK + 2)
    scale = rows[..., d:].contiguous().view(torch.float16).float()  # (..., D / 32)
    codes = rows[..., :d].float().reshape(*lead, d // ops.KV_INT8_BLOCK, ops.KV_INT8_BLOCK)
    return (codes * scale[..., None]).reshape(*lead, d)


def attend_rows(
    q: torch.Tensor,  # (B, M, Hkv, G, D)
    keys: torch.Tensor,  # (B, L, Hkv, D), L a multiple of CHUNK
    values: torch.Tensor,  # (B, L, Hkv, D)
    hidden: torch.Tensor,  # (B, 1, n, R, CHUNK) bool, True for keys a row must not see (RowBatch.hidden)
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of each row over its visible keys in float32; returns (B, M, Hkv, G, D)."""
    b, m, hkv, g, d = q.shape
    n = keys.shape[1] // CHUNK
    rows = m * g
    qh = q.permute(0, 2, 1, 3, 4).reshape(b, hkv, 1, rows, d).float()
    if rows % ROW_TILE:  # whole tiles of rows: fp32 matmuls compute a partial tile with another kernel
        qh = torch.cat([qh, qh.new_zeros(b, hkv, 1, ROW_TILE - rows % ROW_TILE, d)], dim=3)
    kc = keys.float().view(b, n, CHUNK, hkv, d).permute(0, 3, 1, 2, 4)  # (B, Hkv, n, C, D)
    vc = values.float().view(b, n, CHUNK, hkv, d).permute(0, 3, 1, 2, 4)  # (B, Hkv, n, C, D)
    scores = torch.matmul(qh, kc.transpose(-1, -2)).mul_(scale)  # (B, Hkv, n, R, C)
    if softcap:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(hidden, float("-inf"))
    weights = scores.sub_(scores.amax(dim=(2, 4), keepdim=True)).exp_()  # masked keys: exact zeros
    denom = weights.sum(-1, keepdim=True).cumsum(2)[:, :, -1:]  # (B, Hkv, 1, R, 1): chunks added in position order
    out = torch.matmul(weights.div_(denom), vc).cumsum(2)[:, :, -1, :rows]  # (B, Hkv, R, D), normalised first
    return out.view(b, hkv, m, g, d).permute(0, 2, 1, 3, 4)
