"""GGUF's quantised weight blocks in pure torch: dequantisation, and the matmul against quantised weights.

A GGUF file stores most weights in ggml's quantised blocks (Q4_0, Q5_0, Q8_0: 32 elements; Q4_K, Q5_K, Q6_K:
256-element super-blocks with 6- or 8-bit sub-block scales). Multiplying against those bytes directly reads a quarter
to a half of bf16's bytes per token, which is what a memory-bound CPU decode step pays for. A native C kernel is the
fast path for that matmul; this module is its torch fallback and its test oracle:

- `dequantize` turns blocks into float32, bit for bit equal to `gguf.quants.dequantize` (same float operations in the
  same order), for loading and for embedding lookups (`dequantize_rows`).
- `gguf_matmul` computes x @ W.T the way the kernel does. The activations are quantised to int8 per block of 32
  (`quantize_activations`), so each 32-element block's dot product against the weights' integer codes is an exact
  integer (|sum| < 2^24, exact in float32 in any summation order). A row's result then depends only on its own
  activations, its per-block float scales and a fixed, per-row order of float operations over the blocks, never on
  how many other rows share the call: the engine's batch invariance (a request's text must not depend on the load).

The arithmetic of `quantize_activations` is specified exactly (float32 throughout) because the C kernel must
reproduce its codes bit for bit; `gguf_matmul` need not match the kernel bit for bit, only closely.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q4_0 = int(GGMLQuantizationType.Q4_0)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)

SUPPORTED: frozenset[int] = frozenset({Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K})

ACT_BLOCK = 32  # activations are quantised per 32 elements: every supported type's scales are constant over 32
_CHUNK_ELEMS = 1 << 23  # weight elements decoded at once by gguf_matmul (32 MiB as float32), whatever K is
_ISUM_ELEMS = 1 << 22  # block dot products held at once (blocks x M x weight rows)


class _Fields(NamedTuple):
    """One type's blocks decoded into integers and float32 factors, all per tensor row (N rows, K elements).

    A weight element is `d * q` for the 32-blocks, `(d * sc) * q - dmin * m` for Q4_K/Q5_K and `(d * sc) * q` for
    Q6_K, with d/dmin broadcast over their super-block and sc/m over their sub-block.
    """

    q: torch.Tensor  # (N, K) int16: each element's integer code, the type's offset already removed
    d: torch.Tensor  # (N, K // block) float32: the fp16 scale of each ggml block
    sc: torch.Tensor | None  # (N, K // sub) int16: sub-block scales (K-quants; 32 wide, Q6_K's 16 wide)
    dmin: torch.Tensor | None  # (N, K // 256) float32: the fp16 min scale of each super-block (Q4_K, Q5_K)
    m: torch.Tensor | None  # (N, K // 32) int16: sub-block mins (Q4_K, Q5_K)


def _sizes(ggml_type: int) -> tuple[int, int]:
    if ggml_type not in SUPPORTED:
        raise ValueError(f"unsupported ggml type {ggml_type}; supported: {sorted(SUPPORTED)}")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return block, type_size


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k elements of this type."""
    block, type_size = _sizes(ggml_type)
    if k <= 0 or k % block:
        raise ValueError(f"row width {k} is not a positive multiple of the block size {block}")
    return k // block * type_size


# --- decoding the blocks ---------------------------------------------------------------------------------------------


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian fp16 bytes -> (...) float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2, n): low nibbles, then high nibbles (ggml puts them n elements apart)."""
    return torch.stack((b & 0x0F, b >> 4), dim=-2)


def _bits(b: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """(..., n) bytes -> (..., len(shifts), n): the field at each shift of every byte."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def _decode_q4_0(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    q = _nibbles(blk[..., 2:18]).to(torch.int16) - 8  # element j: low nibble of byte j; j + 16: its high nibble
    return _Fields(q.reshape(n, nb * 32), _fp16(blk[..., 0:2]), None, None, None)


def _decode_q5_0(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    # qh is a little-endian uint32 whose bit j is element j's fifth bit: bit j % 8 of byte j // 8.
    high = _bits(blk[..., 2:6], range(8), 1).transpose(-1, -2).reshape(n, nb, 32)
    low = _nibbles(blk[..., 6:22]).reshape(n, nb, 32)
    q = (low | (high << 4)).to(torch.int16) - 16
    return _Fields(q.reshape(n, nb * 32), _fp16(blk[..., 0:2]), None, None, None)


def _decode_q8_0(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    q = blk[..., 2:34].contiguous().view(torch.int8).to(torch.int16)
    return _Fields(q.reshape(n, nb * 32), _fp16(blk[..., 0:2]), None, None, None)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, each (..., 8) int16.

    Bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; scales/mins 4-7 keep their low 4 bits in
    the nibbles of bytes 8-11 and their top 2 bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    s = s.to(torch.int16)
    lo_d, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo_d & 0x3F, (hi & 0x0F) | ((lo_d >> 2) & 0x30)), dim=-1)
    m = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)), dim=-1)
    return sc, m


def _decode_q4_k(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    sc, m = _k_scales_mins(blk[..., 4:16])
    # 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its high nibbles sub-block 2c + 1.
    q = _nibbles(blk[..., 16:144].reshape(n, nb, 4, 32)).to(torch.int16)
    return _Fields(
        q.reshape(n, nb * 256), _fp16(blk[..., 0:2]), sc.reshape(n, nb * 8), _fp16(blk[..., 2:4]), m.reshape(n, nb * 8)
    )


def _decode_q5_k(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    sc, m = _k_scales_mins(blk[..., 4:16])
    high = _bits(blk[..., 16:48], range(8), 1)  # sub-block j's fifth bits: bit j of the 32 qh bytes
    low = _nibbles(blk[..., 48:176].reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)  # as Q4_K
    q = (low | (high << 4)).to(torch.int16)
    return _Fields(
        q.reshape(n, nb * 256), _fp16(blk[..., 0:2]), sc.reshape(n, nb * 8), _fp16(blk[..., 2:4]), m.reshape(n, nb * 8)
    )


def _decode_q6_k(blk: torch.Tensor) -> _Fields:
    n, nb, _ = blk.shape
    # Two halves of 128 elements. In half h, element p's low 4 bits are nibble p // 64 of ql byte 64h + p % 64, and
    # its top 2 bits are bits 2 * (p // 32) of qh byte 32h + p % 32.
    low = _nibbles(blk[..., 0:128].reshape(n, nb, 2, 64)).reshape(n, nb, 2, 128)
    high = _bits(blk[..., 128:192].reshape(n, nb, 2, 32), range(0, 8, 2), 3).reshape(n, nb, 2, 128)
    q = (low | (high << 4)).to(torch.int16) - 32
    sc = blk[..., 192:208].contiguous().view(torch.int8).to(torch.int16)  # one signed scale per 16 elements
    return _Fields(q.reshape(n, nb * 256), _fp16(blk[..., 208:210]), sc.reshape(n, nb * 16), None, None)


_DECODERS = {
    Q4_0: _decode_q4_0,
    Q5_0: _decode_q5_0,
    Q8_0: _decode_q8_0,
    Q4_K: _decode_q4_k,
    Q5_K: _decode_q5_k,
    Q6_K: _decode_q6_k,
}


def _decode(raw: torch.Tensor, ggml_type: int, k: int) -> _Fields:
    expected = row_bytes(ggml_type, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected:
        raise ValueError(f"expected uint8 weights of shape (N, {expected}), got {raw.dtype} {tuple(raw.shape)}")
    _, type_size = _sizes(ggml_type)
    return _DECODERS[ggml_type](raw.reshape(raw.shape[0], -1, type_size))


def _per(t: torch.Tensor, width: int) -> torch.Tensor:
    """Repeat each column of a per-block tensor so that it has `width` columns (a coarser scale over finer blocks)."""
    return t.repeat_interleave(width // t.shape[1], dim=1)


# --- dequantisation --------------------------------------------------------------------------------------------------


def dequantize(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """(N, row_bytes) uint8 blocks -> (N, k) float32, bit for bit equal to `gguf.quants.dequantize`."""
    f = _decode(raw, ggml_type, k)
    n = raw.shape[0]
    # gguf's numpy code rounds the same float32 products in the same order: sub-block scale d * sc first, times the
    # code, minus the sub-block min dmin * m.
    scale = f.d if f.sc is None else _per(f.d, f.sc.shape[1]) * f.sc.float()
    w = scale.unsqueeze(-1) * f.q.float().reshape(n, scale.shape[1], -1)
    if f.dmin is not None and f.m is not None:
        w = w - (_per(f.dmin, f.m.shape[1]) * f.m.float()).unsqueeze(-1)
    return w.reshape(n, k)


def dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """The float32 rows `ids` (any shape) of a quantised matrix: an embedding lookup, (*ids.shape, k)."""
    rows = dequantize(raw[ids.reshape(-1)], ggml_type, k)
    return rows.reshape(*ids.shape, k)


# --- the matmul ------------------------------------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float activations -> int8 codes (M, K) and float32 scales (M, K // 32), one per block of 32.

    Per block, in float32: amax = max|x|; d = amax / 127 and q = round_half_even(x * (127 / amax)) clamped to
    [-127, 127]; an all-zero block gets d = 0, q = 0; a block holding NaN or inf gets d = NaN, q = 0, so that the NaN
    reaches that row's outputs instead of being lost in the int8 cast. The C kernel reproduces exactly this.
    """
    if x.dim() != 2 or x.shape[1] % ACT_BLOCK:
        raise ValueError(f"expected (M, K) activations with K a multiple of {ACT_BLOCK}, got {tuple(x.shape)}")
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN if the block holds one, inf if it holds inf
    finite = torch.isfinite(amax)
    nonzero = finite & (amax > 0)
    # Placeholder 1 where the block is zero or not finite, so no inf/NaN enters the codes; those blocks are zeroed.
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    inv = torch.full_like(safe, 127.0) / safe  # float32 reciprocal first, then the float32 multiply
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127)
    q = torch.where(nonzero.unsqueeze(-1), q, torch.zeros_like(q)).to(torch.int8)
    d = torch.where(nonzero, safe / torch.full_like(safe, 127.0), torch.zeros_like(safe))
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    return q.reshape(m, k), d


def _weight_operands(f: _Fields, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decoded blocks -> integer codes (N, K) float32, per-32 scale (N, K // 32), per-32 min (N, K // 32) or None.

    A weight element is scale * code - min, with the scale and min constant over each 32-block, so a block's dot
    product with the int8 activations is an exact integer times the scale.
    """
    n_sub = k // ACT_BLOCK
    if f.sc is None:  # 32-blocks: the fp16 d is the scale
        return f.q.float(), f.d, None
    if f.sc.shape[1] > n_sub:  # Q6_K: fold the 16-wide int8 scales into the codes (|q * sc| <= 4096, exact)
        codes = f.q * _per(f.sc, k)
        return codes.float(), _per(f.d, n_sub), None
    assert f.dmin is not None and f.m is not None  # Q4_K, Q5_K: d * sc and dmin * m per 32, in float32 as ggml does
    return f.q.float(), _per(f.d, n_sub) * f.sc.float(), _per(f.dmin, n_sub) * f.m.float()


def _block_dots(
    qx: torch.Tensor,
    dx: torch.Tensor,
    xsum: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    wmin: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk of weight rows: y = sum_b dx_b * scale_b * isum_b - sum_b dx_b * min_b * xsum_b, as (M, n).

    qx is (B, M, 32) float32 activation codes, dx and xsum (B, M); codes (n, B * 32), scale and wmin (n, B).
    """
    n_blocks, m, _ = qx.shape
    n = codes.shape[0]
    cw = codes.reshape(n, n_blocks, ACT_BLOCK).permute(1, 2, 0)  # (B, 32, n)
    scale_t = scale.t()
    wmin_t = None if wmin is None else wmin.t()
    acc = torch.zeros(m, n, dtype=torch.float32)
    macc = torch.zeros(m, n, dtype=torch.float32)
    group = max(1, min(n_blocks, _ISUM_ELEMS // max(1, m * n)))
    for g0 in range(0, n_blocks, group):
        # Exact integers (|isum| <= 32 * 127 * 4096 < 2^24), so the matmul's summation order cannot change them.
        isum = torch.bmm(qx[g0 : g0 + group], cw[g0 : g0 + group])
        # Blocks accumulate one at a time, in block order, with separate multiplies and adds (no fused multiply-add
        # that a vectorised kernel might use for some elements and not others): each output element sees the same
        # float operations whatever M is.
        for j in range(isum.shape[0]):
            b = g0 + j
            acc += (dx[b].unsqueeze(1) * scale_t[b]) * isum[j]
            if wmin_t is not None:
                macc += (dx[b].unsqueeze(1) * wmin_t[b]) * xsum[b].unsqueeze(1)
    return acc if wmin_t is None else acc - macc


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """x (M, k) float @ W.T for W given as GGUF blocks raw (N, row_bytes): (M, N) float32, batch invariant.

    Activations are quantised per 32 (`quantize_activations`); per 32-block the integer dot product with the
    weights' codes is exact and is scaled by d_x * weight scale, then the blocks are summed in a fixed order per row.
    A block with non-finite activations (d_x = NaN) makes that row's outputs NaN.
    """
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected activations of shape (M, {k}), got {tuple(x.shape)}")
    m = x.shape[0]
    n_blocks = k // ACT_BLOCK
    q, dx = quantize_activations(x)
    qx = q.float().reshape(m, n_blocks, ACT_BLOCK).transpose(0, 1).contiguous()  # (B, M, 32)
    xsum = qx.sum(dim=-1)  # (B, M) exact integers: the activations' share of the K-quants' mins
    dx_t = dx.t().contiguous()
    out = torch.empty(m, raw.shape[0], dtype=torch.float32)
    rows = max(1, _CHUNK_ELEMS // k)  # so a 262144-row LM head never decodes all of itself at once
    for r0 in range(0, raw.shape[0], rows):
        codes, scale, wmin = _weight_operands(_decode(raw[r0 : r0 + rows], ggml_type, k), k)
        out[:, r0 : r0 + rows] = _block_dots(qx, dx_t, xsum, codes, scale, wmin)
    return out
