"""The C kernels' Python side: one wrapper per kernel, and whether each can run here.

Our C kernels serve the bf16 hot path where eager torch is slow on a CPU, mostly through fixed per-op costs:
- fused.c: the norms, norm + residual add and q/k norm + rotary of a decoder layer, each one call in place of the
  five to fifteen small eager ops torch would run. torch has no CPU fusion for them short of torch.compile, whose
  compile time would exceed our whole start-up.
- int8_matmul.c (linear.TiledInt8Linear): the weight-only int8 matmul, int16 activations against int8 weights with
  exact int32 sums (see its header).
- paged_attention.c: attention over the paged cache, one call per layer in place of dozens of ops.
- gelu.c: the gated GELU in one pass; argmax.c: greedy decoding's argmax in one vectorised pass.
- decoder_layer.c: a whole Gemma 3 or Llama-family layer on the bf16 + GGUF path (the kernels above, back to back)
  in one call.
- token_splits.c, not a model kernel: the two-piece splits of a vocabulary's pieces, for the Gemma GGUF tokenizer's
  merges (tokenizer/splits.py), a part of every start that numpy took ~0.7 s over.
docs/decisions/ records what each gains. Each computes the arithmetic of the torch path it replaces.

build.py compiles them on first use and caches the build. `library()` is that library, or None where it could not be
built (no compiler, an unsafe cache directory; build.py logs why) or TOKENMILL_FUSED=0 turns it off; `usable(x)` says
whether a tensor takes the C path (bf16 on the CPU, and a library). Each threaded kernel also says whether it was
compiled in (`*_available()`): each needs AVX-512 (VNNI for the int8 and GGUF matmuls) or AVX2 + FMA (and F16C for
the GGUF matmul), and OpenMP; where one is missing its caller keeps the torch path, which runs the same arithmetic in torch ops.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.kernels import build

_LIMITS = build.header_defines()  # kernels.h: the C side's limits, read rather than copied
MAX_HEAD_DIM = _LIMITS["MAX_HEAD_DIM"]  # norm_rotary's stack buffer
MAX_ATTENTION_HEAD_DIM = _LIMITS["MAX_ATTENTION_HEAD_DIM"]  # paged_attention's register tile
KV_INT8_BLOCK = _LIMITS["KV_INT8_BLOCK"]  # an 8-bit KV cache row's codes per float16 scale
ATTENTION_KEY_CHUNK = _LIMITS["ATTENTION_KEY_CHUNK"]  # paged_attention's keys per chunk of a longer row
INT8_MATMUL_TILE = _LIMITS["INT8_MATMUL_TILE"]  # int8_matmul's output columns per tile
INT8_MATMUL_K_MULTIPLE = _LIMITS["INT8_MATMUL_K_MULTIPLE"]  # its input width must be a multiple of this
GGUF_XBLOCK_BYTES = _LIMITS["GGUF_XBLOCK_BYTES"]  # gguf_matmul's quantised activations: bytes per 32 inputs
GGUF_GROUP = _LIMITS["GGUF_GROUP"]  # gguf_matmul's output columns per regrouped group
GGUF_Q8_0_HIGH6 = _LIMITS["GGUF_Q8_0_HIGH6"]  # a Q8_0 head's codes less two bits (gguf_greedy_row's copy)
STACK_KINDS = _LIMITS["STACK_KINDS"]  # the (rope, key lists) pairs one decoder_stack call tells its layers apart by
GGUF_LINEAR_MAX_PARTS = _LIMITS["GGUF_LINEAR_MAX_PARTS"]  # a projection's parts in decoder_layer.c's plan
LORA_MAX_PARTS = _LIMITS["LORA_MAX_PARTS"]  # the parts of one adapter's update of a projection (lora.c)
LORA_PROJECTIONS = _LIMITS["LORA_PROJECTIONS"]  # a layer's projections an adapter may update, in the plan's order


_loading = threading.Lock()


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None: turned off (TOKENMILL_FUSED=0), or not buildable here. Threads that ask before
    the first answer is cached (a GGUF's tokenizer is built on a thread of its own while the weights load) take
    turns, so a first start compiles once."""
    if os.environ.get("TOKENMILL_FUSED", "1") == "0":
        return None
    with _loading:
        return build.library()


def _lib() -> ctypes.CDLL:
    """The library, for a wrapper whose caller checked `usable` or an `*_available()` first."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C kernels are not loaded: check ops.usable() or the kernel's *_available() first")
    return lib


@cache
def _built(kernel: str) -> bool:
    """Whether `kernel` was compiled in: it says so itself (`<kernel>_available()`), as its CPU features and OpenMP
    were or were not there at compile time."""
    lib = library()
    return lib is not None and getattr(lib, f"{kernel}_available")() == 1


def int8_matmul_available() -> bool:
    """AVX-512 (F, BW, VL, VNNI) or AVX2 + FMA, and OpenMP (see int8_matmul.c)."""
    return _built("int8_matmul")


def gguf_matmul_available() -> bool:
    """AVX-512 (F, BW, VL, VNNI) or AVX2 + FMA, with F16C, and OpenMP (see gguf_packed.h)."""
    return _built("gguf_matmul")


def gguf_amx(enable: bool | None = None) -> bool:
    """Whether gguf_matmul runs its batches of 16 rows and more on AMX tiles (compiled in for this CPU, granted by
    the OS, and wanted). `enable` sets the wanting: both paths give the same bits, and the tests compare them."""
    lib = library()
    if lib is None or not gguf_matmul_available():
        return False
    return lib.gguf_amx(-1 if enable is None else int(enable)) == 1


def paged_attention_available() -> bool:
    """AVX-512F or AVX2 + FMA, and OpenMP (see paged_attention.c)."""
    return _built("paged_attention")


def argmax_available() -> bool:
    """AVX-512F or AVX2 + FMA, and OpenMP (see argmax.c)."""
    return _built("argmax")


def gelu_mul_available() -> bool:
    """AVX-512F or AVX2 + FMA, and OpenMP (see gelu.c)."""
    return _built("gelu_mul")


def silu_mul_available() -> bool:
    """Compiled with gelu_mul, in gelu.c."""
    return _built("gelu_mul")


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and library() is not None


def rms_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., D) bf16 → bf16(x · rsqrt(mean(x²) + eps) · factor)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _lib().rms_norm(x.data_ptr(), dim, factor.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., D) bf16 → bf16(weight · bf16(x · rsqrt(mean(x²) + eps))), `weight` float32: Llama's RMSNorm."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _lib().weighted_rms_norm(x.data_ptr(), dim, weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def add_rms_norm(residual: torch.Tensor, y: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """residual + rms_norm(y), both (T, D) bf16."""
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    _lib().add_rms_norm(residual.data_ptr(), y.data_ptr(), factor.data_ptr(), out.data_ptr(), *y.shape, eps)
    return out


def norm_rotary(
    x: torch.Tensor, factor: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: (T, H, D) bf16 whose heads are packed within each row (rows may be strided) → normed and rotated, packed."""
    t, heads, d = x.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is over the kernel's {MAX_HEAD_DIM}; use the torch path")
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype)
    _lib().norm_rotary(
        x.data_ptr(),
        x.stride(0),
        factor.data_ptr(),
        cos.data_ptr(),
        signed_sin.data_ptr(),
        out.data_ptr(),
        t,
        heads,
        d,
        eps,
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) bf16 whose heads are packed within each row (rows may be strided); cos / signed_sin (T, D) bf16 →
    each head rotated ("rotate half"), packed (T, H, D)."""
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype)
    _lib().rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), t, heads, d)
    return out


def int8_matmul(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, n: int, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x: (M, K) bf16 @ the (N, K) int8 weights laid out in `tiles` (see int8_matmul.c) * scale → (M, N) bf16 or
    float32 (`out_dtype`)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    float_out = int(out_dtype == torch.float32)
    if m and _lib().int8_matmul(
        x.data_ptr(), m, k, tiles.data_ptr(), scale.data_ptr(), n, out.data_ptr(), float_out, torch.get_num_threads()
    ):
        raise MemoryError(f"int8_matmul: no memory for a ({m}, {k}) int16 scratch")
    return out


def gguf_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x: (M, K) bf16 → the int8 activation blocks gguf_matmul makes of it inside, uint8 (M, K / 32 *
    GGUF_XBLOCK_BYTES): exported so the tests can hold them equal to torch's quantize_activations."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, k // 32 * GGUF_XBLOCK_BYTES, dtype=torch.uint8)
    if _lib().gguf_quantize_rows(x.data_ptr(), x.stride(0), m, k, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"gguf_quantize_rows: the input width {k} is not a multiple of 32")
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    offset: torch.Tensor,
    count: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) bf16; caches (slots, Hkv, D) bf16, or (slots, Hkv, D + 2 D / KV_INT8_BLOCK) int8 (codes and
    their scales, kv_quantize_rows); row r attends to slots[offset[r] : offset[r] + count[r]]. `softcap`: scores
    become softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    t, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(t, hq, d, dtype=torch.bfloat16)
    if t and _lib().paged_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        offset.data_ptr(),
        count.data_ptr(),
        t,
        hq,
        k_cache.shape[1],
        d,
        scale,
        softcap or 0.0,
        int(k_cache.dtype == torch.int8),
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise ValueError(f"paged_attention: head_dim {d} unsupported or no memory for the scores")
    return out


def kv_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) bf16 → (..., D + 2 D / KV_INT8_BLOCK) int8: each row's codes, then their float16 scales
    (kv_quantize_rows in C, compiled with paged_attention)."""
    x = x.contiguous()
    d = x.shape[-1]
    if d % KV_INT8_BLOCK:
        raise ValueError(f"kv_quantize_rows: rows of {d}, not a multiple of {KV_INT8_BLOCK}")
    out = torch.empty(*x.shape[:-1], d + 2 * d // KV_INT8_BLOCK, dtype=torch.int8)
    _lib().kv_quantize_rows(x.data_ptr(), x.numel() // d, d, out.data_ptr())
    return out


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) bf16, rows contiguous → gelu_tanh(gate) · up, (T, F) bf16 (gelu.c)."""
    return _gated("gelu_mul", gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) bf16, rows contiguous → silu(gate) · up, (T, F) bf16 (gelu.c)."""
    return _gated("silu_mul", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, f, dtype=torch.bfloat16)
    getattr(_lib(), kernel)(gate_up.data_ptr(), gate_up.stride(0), t, f, out.data_ptr(), torch.get_num_threads())
    return out


def copy_regions(src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> None:
    """Region i of `nbytes` bytes copied from address src[i] to dst[i] (int64 tensors of addresses, regions apart):
    one C call (copy_regions.c), or one memmove each without the kernels."""
    src, dst = src.reshape(-1).contiguous(), dst.reshape(-1).contiguous()
    if src.dtype != torch.int64 or dst.dtype != torch.int64 or src.numel() != dst.numel():
        raise ValueError("copy_regions: src and dst must be int64 addresses, as many of each")
    lib = library()
    if lib is None:
        for s, d in zip(src.tolist(), dst.tolist()):
            ctypes.memmove(d, s, nbytes)
        return
    lib.copy_regions(src.data_ptr(), dst.data_ptr(), src.numel(), nbytes, torch.get_num_threads())


def argmax_rows(x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() for (rows, n) float32 logits: the C pass (argmax.c) where it compiled."""
    if not (argmax_available() and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()):
        return x.argmax(dim=-1).tolist()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if _lib().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("argmax_rows: no memory for the per-segment results")
    return out.tolist()


def gguf_packed_bytes(ggml_type: int, n: int, k: int) -> int:
    """The bytes of N rows of K weights of `ggml_type` regrouped by gguf_repack (N padded to whole groups)."""
    size = int(_lib().gguf_packed_bytes(ggml_type, n, k))
    if size < 0:
        raise ValueError(f"gguf_repack: ggml type {ggml_type} with rows of {k} has no packed layout")
    return size


def gguf_dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a GGUF table's (N, row bytes) blocks as float32 (*ids.shape, K), bit for bit
    gguf_quant.dequantize_rows' (gguf_dequant.c). Plain C: it needs the library, no instruction set."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if not raw.is_contiguous() or raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError("gguf_dequantize_rows: a contiguous (N, row bytes) uint8 table")
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < raw.shape[0]:
        raise IndexError(f"gguf_dequantize_rows: ids out of range for a table of {raw.shape[0]} rows")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    if _lib().gguf_dequantize_rows(ggml_type, raw.data_ptr(), k, flat.data_ptr(), flat.numel(), out.data_ptr()):
        raise ValueError(f"gguf_dequantize_rows: ggml type {ggml_type} with rows of {k} is not one it decodes")
    return out.reshape(*ids.shape, k)


def gguf_packed_empty(ggml_type: int, n: int, k: int) -> torch.Tensor:
    """An unwritten buffer for N rows of K weights of `ggml_type` regrouped by gguf_repack."""
    return torch.empty(gguf_packed_bytes(ggml_type, n, k), dtype=torch.uint8)


def gguf_repack(weight: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The file's (N, row bytes) blocks regrouped in 16-column groups for gguf_matmul (gguf_packed.h says how;
    about as many bytes per column), N padded to a multiple of 16; into `out` (uint8, gguf_packed_bytes long) where
    given, e.g. memory from a huge_pages.Arena, as a model holds its weights."""
    out = gguf_packed_empty(ggml_type, weight.shape[0], k) if out is None else out
    gguf_repack_all([RepackJob(weight.contiguous(), ggml_type, k, out, 0)])
    return out


class RepackJob(NamedTuple):
    """`weight`'s (N, row bytes) contiguous blocks of N rows of K weights, regrouped into `out` from byte `at` on.
    `file_backed`: the weight lies in a private, never-written mapping of a file, whose pages are dropped from the
    process once read (they stay in the page cache)."""

    weight: torch.Tensor
    ggml_type: int
    k: int
    out: torch.Tensor
    at: int
    file_backed: bool = False


def gguf_repack_all(jobs: Sequence[RepackJob]) -> None:
    """Every job as gguf_repack does it, in one C call: no GIL is taken back between them, and each file-backed
    weight's pages go as soon as it is regrouped (see gguf_repack_all in gguf_repack.c)."""
    for job in jobs:
        size = gguf_packed_bytes(job.ggml_type, job.weight.shape[0], job.k)
        if not job.weight.is_contiguous() or job.at < 0 or job.at + size > job.out.nbytes:
            raise ValueError("gguf_repack: a contiguous weight, and room for its groups in out from `at` on")
    count = len(jobs)
    status = _lib().gguf_repack_all(
        count,
        (ctypes.c_int * count)(*(job.ggml_type for job in jobs)),
        (ctypes.c_void_p * count)(*(job.weight.data_ptr() for job in jobs)),
        (ctypes.c_int64 * count)(*(job.weight.shape[0] for job in jobs)),
        (ctypes.c_int64 * count)(*(job.k for job in jobs)),
        (ctypes.c_void_p * count)(*(job.out.data_ptr() + job.at for job in jobs)),
        (ctypes.c_int64 * count)(*(job.weight.nbytes if job.file_backed else 0 for job in jobs)),
        torch.get_num_threads(),
    )
    if status:
        raise ValueError("gguf_repack: a job's type or width has no packed layout")


def gguf_matmul(x: torch.Tensor, ggml_type: int, packed: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """x: (M, K) bf16 with contiguous rows @ the N rows of K weights of `ggml_type` that gguf_repack regrouped into
    `packed` → out: (M, ≥N) bf16 or float32 with contiguous rows, its first N columns written (a column slice of a
    wider output is fine). The rows are quantised to int8 per 32 inside (gguf_quantize_rows' arithmetic)."""
    m = x.shape[0]
    if x.stride(-1) != 1 or out.stride(-1) != 1 or out.shape[0] != m or out.shape[1] < n:
        raise ValueError("gguf_matmul: x (M, K) and out (M, >= N) must have contiguous rows")
    gguf_matmul_into(x, out, ggml_type, packed, n, 0)


def gguf_matmul_into(x: torch.Tensor, out: torch.Tensor, ggml_type: int, packed: torch.Tensor, n: int, at: int) -> None:
    """gguf_matmul into columns [at, at + N) of `out`, for a caller that made x (M, K) bf16 and out (M, >= at + N),
    both with contiguous rows, itself (GgufLinear: the decode step's hot path), so the shapes are not checked."""
    m, k = x.shape
    status = _lib().gguf_matmul(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        ggml_type,
        packed.data_ptr(),
        n,
        out.data_ptr() + at * out.element_size(),
        out.stride(0),
        out.dtype == torch.float32,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"gguf_matmul: no memory to quantise ({m}, {k}) inputs")
    if status:
        raise ValueError(f"gguf_matmul: ggml type {ggml_type} with rows of {k} is not a layout this kernel takes")


def gguf_matmul_gated(x: torch.Tensor, ggml_type: int, packed: torch.Tensor, f: int, gelu: bool) -> torch.Tensor:
    """x: (M, K) bf16 with contiguous rows @ a gated MLP's gate and up weights regrouped as one part (the gate's f
    columns, then the up's) → (M, f) bf16, gelu_tanh (or silu) of the gate's products times the up's: the bits of
    gguf_matmul into (M, 2f) followed by gelu_mul (or silu_mul), in one pass (the decoder layer's path)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("gguf_matmul_gated: x (M, K) must have contiguous rows")
    out = torch.empty(m, f, dtype=torch.bfloat16)
    status = _lib().gguf_matmul_gated(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        ggml_type,
        packed.data_ptr(),
        f,
        out.data_ptr(),
        f,
        gelu,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"gguf_matmul_gated: no memory to quantise ({m}, {k}) inputs")
    if status:
        raise ValueError(f"gguf_matmul_gated: ggml type {ggml_type}, rows of {k}, f {f} (a multiple of 16) not taken")
    return out


def gguf_matmul_logits(
    x: torch.Tensor, ggml_type: int, packed: torch.Tensor, n: int
) -> tuple[torch.Tensor, list[int], list[bool]]:
    """x: (M, K) bf16 with contiguous rows @ an LM head's N rows regrouped → (M, N) float32 logits (gguf_matmul's
    bits), each row's argmax (the first index of its largest value, as torch.argmax) and whether the row is all
    finite, found in the product's own pass instead of two passes over the logits after it. A row that is not finite
    has no meaningful argmax."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("gguf_matmul_logits: x (M, K) must have contiguous rows")
    out = torch.empty(m, n, dtype=torch.float32)
    argmax = torch.empty(m, dtype=torch.int64)
    finite = torch.empty(m, dtype=torch.int32)
    status = _lib().gguf_matmul_logits(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        ggml_type,
        packed.data_ptr(),
        n,
        out.data_ptr(),
        n,
        argmax.data_ptr(),
        finite.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"gguf_matmul_logits: no memory to quantise ({m}, {k}) inputs")
    if status:
        raise ValueError(
            f"gguf_matmul_logits: ggml type {ggml_type} with rows of {k} is not a layout this kernel takes"
        )
    return out, argmax.tolist(), [bool(f) for f in finite.tolist()]


def gguf_greedy_row(
    x: torch.Tensor, high6: torch.Tensor, packed: torch.Tensor, n: int, keep: Sequence[int]
) -> tuple[torch.Tensor, int] | None:
    """One greedy row's LM head, exactly, from its Q8_0 head's GGUF_Q8_0_HIGH6 copy (gguf_repack) and the head itself:
    x (1, K) bf16 → (1, N) float32 logits that are gguf_matmul_logits's where they can hold the row's largest value
    or are `keep`'s (sorted, distinct ids), -inf elsewhere, and the row's argmax (gguf_matmul_logits's). None where
    the kernel cannot answer for this row (a value not finite, or too many columns near the top): the caller takes
    the full pass."""
    if x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError("gguf_greedy_row: x must be one contiguous row")
    out = torch.empty(1, n, dtype=torch.float32)
    # plain ctypes values, not tensors: this runs once a token right after the weights went through the caches,
    # where each torch call finds its code cold
    argmax = ctypes.c_int64()
    ids = (ctypes.c_int64 * len(keep))(*keep)
    status = _lib().gguf_greedy_row(
        x.data_ptr(),
        x.shape[1],
        high6.data_ptr(),
        packed.data_ptr(),
        n,
        ctypes.addressof(ids),
        len(keep),
        out.data_ptr(),
        ctypes.addressof(argmax),
        torch.get_num_threads(),
    )
    return (out, argmax.value) if _greedy_answered("gguf_greedy_row", status, x.shape[1], keep) else None


def _greedy_answered(name: str, status: int, k: int, keep: Sequence[int]) -> bool:
    """gguf_greedy_row's status: 0 answered (True), 1 it cannot answer for this row (False: the full pass); an error
    otherwise."""
    if status == -2:
        raise MemoryError(f"{name}: no memory for the greedy head's scratch")
    if status not in (0, 1):
        raise ValueError(f"{name}: the greedy head takes no rows of {k} with keep {list(keep)[:8]}")
    return status == 0


class GgufPart(ctypes.Structure):
    """kernels.h's gguf_part: one part of a GgufLinear, writing columns [at, at + n) of its output."""

    _fields_ = [("type", ctypes.c_int64), ("packed", ctypes.c_void_p), ("n", ctypes.c_int64), ("at", ctypes.c_int64)]


class GgufProjection(ctypes.Structure):
    """kernels.h's gguf_linear: a (rows, k) @ (k, n) projection made of parts."""

    _fields_ = [
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("parts", ctypes.c_int64),
        ("part", GgufPart * GGUF_LINEAR_MAX_PARTS),
    ]


class DecoderLayerPlan(ctypes.Structure):
    """kernels.h's decoder_layer_plan: what gemma3_layer or llama_layer needs of a layer that does not change between
    steps. The tensors it points into must outlive it (the layer that builds it keeps them)."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("kv_int8", ctypes.c_int32),
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("pre_feedforward_norm", ctypes.c_void_p),
        ("post_feedforward_norm", ctypes.c_void_p),
        ("qk_factor", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("qkv", GgufProjection),
        ("o", GgufProjection),
        ("gate_up", GgufProjection),
        ("down", GgufProjection),
    ]


def decoder_layer_available() -> bool:
    """decoder_layer.c's kernels are all compiled in (the GGUF matmul, paged attention, the gated GELU and SiLU), and the C
    plan's layout is the one ops.DecoderLayerPlan describes."""
    return (
        gguf_matmul_available()
        and paged_attention_available()
        and gelu_mul_available()
        and _lib().decoder_layer_plan_bytes() == ctypes.sizeof(DecoderLayerPlan)
    )


def decoder_layer(
    kernel: str,
    plan: DecoderLayerPlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    slots: torch.Tensor,
    offset: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer in C (`kernel`: gemma3_layer or llama_layer): x (T, hidden) bf16 → the layer's output, a new
    (T, hidden) tensor; this step's K and V written to the cache; cos / signed_sin (T, head_dim) bf16, contiguous;
    row r attends to slots[offset[r] : offset[r] + count[r]]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    k_cache, v_cache = kv_cache
    status = getattr(_lib(), kernel)(
        ctypes.addressof(plan),
        x.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        cos.data_ptr(),
        signed_sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        slots.data_ptr(),
        offset.data_ptr(),
        count.data_ptr(),
        torch.get_num_threads(),
    )
    _raise_for_layer_status(
        kernel, status, x.shape[0], "a plan whose shapes disagree, or a kernel that is not compiled in"
    )
    return out


def _raise_for_layer_status(name: str, status: int, rows: int, causes: str) -> None:
    """decoder_layer.c's statuses: 0 done, -2 no memory for the step's scratch, anything else one of `causes`."""
    if status == -2:
        raise MemoryError(f"{name}: no memory for the scratch of {rows} rows")
    if status:
        raise ValueError(f"{name}: {causes}")


class StackLayer(ctypes.Structure):
    """kernels.h's stack_layer: one layer of a decoder_stack call (its plan, its cache, which of the step's kinds)."""

    _fields_ = [
        ("plan", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("kind", ctypes.c_int64),
    ]


class StackKinds(ctypes.Structure):
    """kernels.h's stack_kinds: per kind, the step's cos / signed sin ((T, head_dim) bf16) and key lists; and the
    step's LoRA updates (a LoraStep's address; None: no row has an adapter)."""

    _fields_ = [(name, ctypes.c_void_p * STACK_KINDS) for name in ("cos", "signed_sin", "slots", "offset", "count")]
    _fields_ += [("lora", ctypes.c_void_p)]


class LoraPart(ctypes.Structure):
    """kernels.h's lora_part: bf16 Bᵀ (scale folded in) in blocks of 16 columns, (ceil(n / 16), rank, 16), adding to
    output columns [at, at + n) from the shrink's columns [r0, r0 + rank)."""

    _fields_ = [(name, ctypes.c_void_p if name == "bt" else ctypes.c_int64) for name in ("bt", "at", "n", "r0", "rank")]


class LoraUpdate(ctypes.Structure):
    """kernels.h's lora_update: one adapter's update of one projection: (rank, k) bf16 A, its parts."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("k", ctypes.c_int64),
        ("rank", ctypes.c_int64),
        ("parts", ctypes.c_int64),
        ("part", LoraPart * LORA_MAX_PARTS),
    ]


class LoraStep(ctypes.Structure):
    """kernels.h's lora_step: a step's groups (an adapter's rows each) and each group's table of updates."""

    _fields_ = [
        ("groups", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("group_end", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
    ]


def lora_update_rows(update: LoraUpdate, rows: Sequence[int], x: torch.Tensor, out: torch.Tensor) -> None:
    """out[rows] += the update's low-rank product of x[rows], in place (x, out: 2-D bf16, contiguous rows); what
    the C layers do for each adapter's rows (tests compare it with model/lora.py's torch path)."""
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("lora_update_rows takes bf16 rows, each contiguous")
    indices = (ctypes.c_int64 * len(rows))(*rows)
    _lib().lora_update_rows(
        ctypes.addressof(update),
        ctypes.addressof(indices),
        len(rows),
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )


def decoder_stack(
    gemma: bool,
    layers: ctypes.Array[StackLayer],
    kinds: StackKinds,
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Every layer in `layers` in one C call, each as gemma3_layer (`gemma`) or llama_layer: x (T, hidden) bf16 →
    the last layer's output, a new tensor. The tensors `layers` and `kinds` point into must outlive the call."""
    x = x.contiguous()
    out, spare = torch.empty_like(x), torch.empty_like(x)
    status = _lib().decoder_stack(
        int(gemma),
        ctypes.addressof(layers),
        len(layers),
        ctypes.addressof(kinds),
        x.data_ptr(),
        out.data_ptr(),
        spare.data_ptr(),
        x.shape[0],
        slot_mapping.data_ptr(),
        torch.get_num_threads(),
    )
    causes = "a plan whose shapes disagree, a kind out of range, or a kernel not compiled in"
    _raise_for_layer_status("decoder_stack", status, x.shape[0], causes)
    return out


class ForwardPlan(ctypes.Structure):
    """kernels.h's forward_plan: what decoder_forward needs around the layers (the embedding's blocks and scale, the
    final norm, each kind's rotary tables). The tensors it points into must outlive it."""

    _fields_ = [
        ("embed", ctypes.c_void_p),
        ("embed_rows", ctypes.c_int64),
        ("embed_type", ctypes.c_int64),
        ("embed_scale", ctypes.c_float),
        ("norm_eps", ctypes.c_float),
        ("norm", ctypes.c_void_p),
        ("norm_weighted", ctypes.c_int64),
        ("cos", ctypes.c_void_p * STACK_KINDS),
        ("signed_sin", ctypes.c_void_p * STACK_KINDS),
        ("rope_rows", ctypes.c_int64 * STACK_KINDS),
    ]


class GreedyHead(ctypes.Structure):
    """kernels.h's greedy_head: a lone greedy row's LM head in decoder_forward's call (gguf_greedy_row's arguments),
    and its status and argmax once done."""

    _fields_ = [
        ("high6", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("keep", ctypes.c_void_p),
        ("kept", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("argmax", ctypes.c_int64),
        ("status", ctypes.c_int64),
    ]


def decoder_forward(
    gemma: bool,
    plan: ForwardPlan,
    layers: ctypes.Array[StackLayer],
    kinds: StackKinds,
    ids: Sequence[int],
    positions: Sequence[int],
    hidden: int,
    slot_mapping: Sequence[int],
    scratch: int,
    out: tuple[torch.Tensor, int] | None = None,
    greedy: GreedyHead | None = None,
) -> torch.Tensor:
    """A step from T token ids to the final norm's output (T, hidden) bf16 in one C call: the
    embedding's rows, the rotary rows of `positions`, every layer of `layers` as decoder_stack runs them (`kinds`: the
    key lists; its cos and sin are picked here; `slot_mapping`: each new row's cache slot), the final norm. What
    `plan`, `layers` and `kinds` point into must outlive the call. `scratch`: the address of room for 2 T rows of bf16,
    overwritten. `out`: a (T, hidden) bf16 output and its address, else a new tensor. The ids, positions and slots
    travel as ctypes arrays, not tensors: a torch call finds its code cold after a step's weights went through the
    caches, so the caller may keep its buffers from step to step.

    `greedy`: gguf_greedy_row's arguments (greedy_head) to run it on the last row in the same call; read its answer
    with greedy_answer."""
    t = len(ids)
    if len(positions) != t or len(slot_mapping) != t:
        raise ValueError(f"decoder_forward: {t} ids, {len(positions)} positions and {len(slot_mapping)} slots")
    rows = [(ctypes.c_int64 * t)(*values) for values in (ids, positions, slot_mapping)]
    x, x_at = out if out is not None else _new_rows(t, hidden)  # the embedded rows, then the output
    status = _lib().decoder_forward(
        int(gemma),
        ctypes.addressof(plan),
        ctypes.addressof(layers),
        len(layers),
        ctypes.addressof(kinds),
        ctypes.addressof(rows[0]),
        ctypes.addressof(rows[1]),
        x_at,
        scratch,
        scratch + t * hidden * 2,
        t,
        ctypes.addressof(rows[2]),
        ctypes.addressof(greedy) if greedy is not None else None,
        torch.get_num_threads(),
    )
    causes = "a token id or position outside its table, a plan whose shapes disagree, or a kernel not compiled in"
    _raise_for_layer_status("decoder_forward", status, t, causes)
    return x


def _new_rows(t: int, hidden: int) -> tuple[torch.Tensor, int]:
    x = torch.empty(t, hidden, dtype=torch.bfloat16)
    return x, x.data_ptr()


def greedy_head(high6: int, packed: int, logits: int, n: int, keep: Sequence[int]) -> GreedyHead:
    """decoder_forward's `greedy`: a lone greedy row's head over the 6-bit copy at `high6` and the regrouped head at
    `packed` of width n (GgufLinear.greedy_parts), writing its (1, n) float32 logits at address `logits`, reading the
    values of the ids `keep` besides its argmax. The struct holds its keep list."""
    kept = (ctypes.c_int64 * len(keep))(*keep)
    head = GreedyHead(high6, packed, n, ctypes.addressof(kept), len(kept), logits)
    head.kept_ids = kept  # alive as long as the struct
    return head


def greedy_answer(head: GreedyHead, hidden: int, keep: Sequence[int]) -> int | None:
    """The argmax of a greedy_head that decoder_forward ran, or None where that pass could not answer for the row
    (the caller takes the full pass); an error otherwise."""
    return head.argmax if _greedy_answered("decoder_forward", head.status, hidden, keep) else None


def token_splits(codes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(left, right) piece indices for every cut of every piece into two pieces (token_splits.c), or None without
    the library. `codes`: the pieces' code points (uint32) one after another; `starts`, `lengths`: int64 per piece."""
    lib = library()
    if lib is None:
        return None
    codes, starts, lengths = (
        np.ascontiguousarray(a, dtype) for a, dtype in ((codes, np.uint32), (starts, np.int64), (lengths, np.int64))
    )
    capacity = int(np.maximum(lengths - 1, 0).sum())
    left, right = np.empty(capacity, np.int64), np.empty(capacity, np.int64)
    found = lib.token_splits(
        codes.ctypes.data,
        starts.ctypes.data,
        lengths.ctypes.data,
        len(lengths),
        left.ctypes.data,
        right.ctypes.data,
        capacity,
    )
    if found < 0:
        raise MemoryError("token_splits: no memory for the pieces' table")
    return left[:found], right[:found]
