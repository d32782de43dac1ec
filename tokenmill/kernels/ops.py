"""Our C kernels, called through ctypes, for the bf16 hot path where torch is slow on a CPU.

- fused.c: the norms, norm + residual add and q/k norm + rotary of a decoder layer. A decode step on this model ran
  ~2,000 eager torch ops, most on a few hundred numbers at ~4 µs each; these take one call instead of five to fifteen
  ops. torch has no CPU fusion for them short of torch.compile, whose compile time would exceed our whole start-up.
- int8_matmul.c (linear.TiledInt8Linear): the weight-only int8 matmul, 1.5x torch's kernel at one row and 2.7x at 16
  (see its header).
- paged_attention.c: attention over the paged cache, one call per layer instead of ~40 ops.
- gelu.c: the gated GELU in one pass; argmax.c: greedy decoding's argmax, ~4x torch's at 16 rows and ~7x at one.

The sources are compiled on first use with the system C compiler (~1 s) and cached by source hash and CPU; without a
compiler, or for other dtypes than bfloat16, `library()` is None and the model runs the same arithmetic in torch ops.
Each kernel also says whether it was compiled in (`*_available()`): the int8 matmul needs AVX-512 VNNI or AVX2, the
others AVX-512F, and all of them OpenMP; where one is missing its caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import platformdirs
import torch

log = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).with_name(name) for name in ("fused.c", "int8_matmul.c", "paged_attention.c", "argmax.c", "gelu.c")
]
HEADERS = [Path(__file__).with_name("avx512_common.h")]
MAX_HEAD_DIM = 1024  # norm_rotary's stack buffer
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "rms_norm": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32],
    "add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "norm_rotary": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _F32],
    "int8_matmul": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int, ctypes.c_int],
    "int8_matmul_available": [],
    "paged_attention": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32, _PTR, ctypes.c_int],
    "paged_attention_available": [],
    "argmax_rows": [_PTR, _I64, _I64, _PTR, ctypes.c_int],
    "argmax_available": [],
    "gelu_mul": [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int],
    "gelu_mul_available": [],
}
_RETURNS_INT = {name for name in _SIGNATURES if name.endswith("_available")} | {
    "int8_matmul",
    "paged_attention",
    "argmax_rows",
}
MAX_ATTENTION_HEAD_DIM = 512  # paged_attention.c's register tile


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("TOKENMILL_FUSED", "1") == "0":
        return None
    try:
        return load(_compiled())
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("fused kernels unavailable (%s); using plain torch ops, which are slower", e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A compiled kernel library, its functions given their C signatures."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, (ctypes.c_int if name in _RETURNS_INT else None)
    return lib


def build(target: Path, march: str = "native") -> None:
    """Compiles the kernels into `target` for the CPU `march` names, with OpenMP where the compiler has it."""
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fPIC", "-shared"]
    command = [_compiler(), *flags, "-o", str(target), *map(str, SOURCES), "-lm"]
    try:  # the threaded kernels need OpenMP; without it the rest still compiles (and those kernels say so)
        subprocess.run([*command, "-fopenmp"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        subprocess.run(command, check=True, capture_output=True)


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    return compiler


def _compiled() -> Path:
    """This CPU's build, cached by source hash and CPU flags."""
    _compiler()  # no compiler: no kernels, even where an earlier build is cached
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(sources + platform.machine().encode() + _cpu_flags()).hexdigest()[:16]
    target = _kernel_dir() / f"fused-{key}.so"
    if not target.is_file():
        tmp = target.with_suffix(f".tmp-{os.getpid()}.so")
        build(tmp)
        os.replace(tmp, target)
    return target


def _cpu_flags() -> bytes:
    try:  # -march=native code must not be reused on another CPU through a shared cache directory
        return next(line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags"))
    except (OSError, StopIteration):
        return b""


def _kernel_dir() -> Path:
    for root in (Path(platformdirs.user_cache_dir("tokenmill")) / "kernels", Path(tempfile.gettempdir()) / "tokenmill"):
        try:
            root.mkdir(parents=True, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        except OSError:
            continue
    raise OSError("no writable directory for the compiled kernels")


@cache
def _built(kernel: str) -> bool:
    """Whether `kernel` was compiled in: it says so itself (`<kernel>_available()`), as its CPU features and OpenMP
    were or were not there at compile time."""
    lib = library()
    return lib is not None and getattr(lib, f"{kernel}_available")() == 1


def int8_matmul_available() -> bool:
    """AVX-512 (F, BW, VL, VNNI) or AVX2 + FMA, and OpenMP (see int8_matmul.c)."""
    return _built("int8_matmul")


def paged_attention_available() -> bool:
    """AVX-512F and OpenMP (see paged_attention.c)."""
    return _built("paged_attention")


def argmax_available() -> bool:
    """AVX-512F and OpenMP (see argmax.c)."""
    return _built("argmax")


def gelu_mul_available() -> bool:
    """AVX-512F and OpenMP (see gelu.c)."""
    return _built("gelu_mul")


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and library() is not None


def rms_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., D) bf16 → bf16(x · rsqrt(mean(x²) + eps) · factor)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().rms_norm(x.data_ptr(), dim, factor.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def add_rms_norm(residual: torch.Tensor, y: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """residual + rms_norm(y), both (T, D) bf16."""
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    library().add_rms_norm(residual.data_ptr(), y.data_ptr(), factor.data_ptr(), out.data_ptr(), *y.shape, eps)
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
    library().norm_rotary(
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


def int8_matmul(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, n: int, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x: (M, K) bf16 @ the (N, K) int8 weights laid out in `tiles` (see int8_matmul.c) * scale → (M, N) bf16 or
    float32 (`out_dtype`)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    float_out = int(out_dtype == torch.float32)
    if m and library().int8_matmul(
        x.data_ptr(), m, k, tiles.data_ptr(), scale.data_ptr(), n, out.data_ptr(), float_out, torch.get_num_threads()
    ):
        raise MemoryError(f"int8_matmul: no memory for a ({m}, {k}) int16 scratch")
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    offset: torch.Tensor,
    count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (T, Hq, D) bf16; caches (slots, Hkv, D) bf16; row r attends to slots[offset[r] : offset[r] + count[r]]."""
    t, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(t, hq, d, dtype=torch.bfloat16)
    if t and library().paged_attention(
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
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise ValueError(f"paged_attention: head_dim {d} unsupported or no memory for the scores")
    return out


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) bf16, rows contiguous → gelu_tanh(gate) · up, (T, F) bf16 (gelu.c)."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, f, dtype=torch.bfloat16)
    library().gelu_mul(gate_up.data_ptr(), gate_up.stride(0), t, f, out.data_ptr(), torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() for (rows, n) float32 logits: the C pass (argmax.c) where it compiled."""
    if not (argmax_available() and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()):
        return x.argmax(dim=-1).tolist()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if library().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("argmax_rows: no memory for the per-segment results")
    return out.tolist()
