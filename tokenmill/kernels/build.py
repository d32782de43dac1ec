"""Compiling, caching and loading the C kernels: one shared library per source version, compiler, OpenMP and CPU.

On first use the sources are compiled with the system C compiler (`CC`, else `cc` or `gcc`) into the user's cache
directory (`~/.cache/tokenmill/kernels`: platformdirs' user cache, which follows XDG_CACHE_HOME) and loaded through
ctypes; later starts load the cached file. Its name carries a key over everything that decides its machine code:
the sources and headers, the flags, the compiler (resolved path and `--version`), whether OpenMP is linked in, and
the machine and this CPU's flags (-march=native code must not run on another CPU through a shared home directory).

Safety: tokenmill runs whatever library it finds under that name, so the directory must be the user's alone. It is
created 0700; before anything is built or loaded there it must be a real directory (not a symlink), owned by the
current user and writable by no one else, and the library a regular file of the user's. A directory of ours that
others can only read (as earlier versions created it) is tightened to 0700; one that others can write to, or that
someone else owns, is refused and the torch paths run instead. There is no fallback to a shared temporary
directory, where anyone could plant a library under the name we would look for. A build is written under a
temporary name in the same directory and renamed into place, so a concurrent start never loads half a file.

Missing pieces cost speed, never correctness: without a compiler there is no library and the model runs its torch
paths; without OpenMP the threaded kernels compile as stubs that report themselves unavailable. Each is logged once
per process, with its fix.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [
    HERE / name
    for name in (
        "fused.c",
        "int8_matmul.c",
        "gguf_quantize.c",
        "gguf_repack.c",
        "gguf_dequant.c",
        "gguf_dot.c",
        "gguf_amx.c",
        "gguf_matmul.c",
        "gguf_greedy_row.c",
        "paged_attention.c",
        "argmax.c",
        "gelu.c",
        "lora.c",
        "decoder_layer.c",
        "token_splits.c",
        "copy_regions.c",
    )
]
KERNELS_H = HERE / "kernels.h"  # the prototypes and limits C and Python share
HEADERS = [
    HERE / name
    for name in (
        "kernels.h",
        "bf16.h",
        "vec16.h",
        "avx512_common.h",
        "avx2_common.h",
        "gguf_packed.h",
        "gguf_lanes.h",
        "gguf_blocks.h",
    )
]
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared"]
DIR_MODE = 0o700
SLOWER = "the torch paths run instead, which are slower (docs/decisions/0002-no-prebuilt-kernels.md)"
OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n"

CType = type[ctypes.c_int64] | type[ctypes.c_float] | type[ctypes.c_int] | type[ctypes.c_void_p]
_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# name -> (return type, argument types): kernels.h's prototypes (tests/kernels/test_signatures.py holds them equal)
SIGNATURES: dict[str, tuple[CType | None, list[CType]]] = {
    "rms_norm": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32]),
    "add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32]),
    "norm_rotary": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _F32]),
    "weighted_rms_norm": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32]),
    "rotary": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]),
    "int8_matmul_available": (_INT, []),
    "int8_matmul": (_INT, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT, _INT]),
    "gguf_matmul_available": (_INT, []),
    "gguf_quantize_rows": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "gguf_matmul": (_INT, [_PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _INT, _INT]),
    "gguf_matmul_gated": (_INT, [_PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _INT, _INT]),
    "gguf_matmul_gated_added": (
        _INT,
        [_PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _INT, _PTR, _PTR, _INT],
    ),
    "gguf_matmul_logits": (_INT, [_PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT]),
    "gguf_greedy_row": (_INT, [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT]),
    "gguf_packed_bytes": (_I64, [_INT, _I64, _I64]),
    "gguf_dequantize_rows": (_INT, [_INT, _PTR, _I64, _PTR, _I64, _PTR]),
    "gguf_repack": (_INT, [_INT, _PTR, _I64, _I64, _PTR, _INT]),
    "gguf_repack_all": (_INT, [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]),
    "gguf_amx": (_INT, [_INT]),
    "paged_attention_available": (_INT, []),
    "paged_attention": (
        _INT,
        [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32, _F32, _INT, _PTR, _INT],
    ),
    "kv_quantize_rows": (None, [_PTR, _I64, _I64, _PTR]),
    "copy_regions": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "argmax_available": (_INT, []),
    "argmax_rows": (_INT, [_PTR, _I64, _I64, _PTR, _INT]),
    "gelu_mul_available": (_INT, []),
    "gelu_mul": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "gated_block": (None, [_PTR, _PTR, _I64, _PTR, _I64, _INT]),
    "silu_mul": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "decoder_layer_plan_bytes": (_I64, []),
    "gemma3_layer": (_INT, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]),
    "llama_layer": (_INT, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]),
    "decoder_stack": (_INT, [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _INT]),
    "decoder_forward": (_INT, [_INT, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
    "token_splits": (_I64, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64]),
    "lora_add": (None, [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]),
    "lora_update_rows": (None, [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _INT]),
    "lora_has": (_INT, [_PTR, _I64, _I64]),
    "lora_deltas": (None, [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _INT]),
}
_warned: set[str] = set()


class UnsafeCache(OSError):
    """The kernel cache directory, or a library in it, could have been written by someone else."""


class NoCompiler(OSError):
    """No C compiler: neither `CC` nor `cc`/`gcc` on PATH runs."""


@dataclass(frozen=True)
class Compiler:
    """A C compiler, with what decides its output: the file it resolves to and what it says its version is."""

    command: str  # as found on PATH (a ccache-style symlink picks its compiler by this name)
    path: str  # the file it resolves to
    version: str  # its `--version` output

    @classmethod
    def find(cls) -> Compiler | None:
        name = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        command = shutil.which(name) if name else None
        if command is None:
            return None
        try:
            run = subprocess.run([command, "--version"], check=True, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return cls(command, os.path.realpath(command), run.stdout.strip())

    def has_openmp(self, scratch: Path) -> bool:
        """Whether this compiler builds and links OpenMP code: a tiny program, compiled in `scratch` and thrown away
        (never run), so that the cache key can say which build it names before anything is built."""
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            source = Path(tmp) / "probe.c"
            source.write_text(OPENMP_PROBE)
            command = [self.command, "-fopenmp", str(source), "-o", str(Path(tmp) / "probe")]
            return subprocess.run(command, check=False, capture_output=True).returncode == 0


def header_defines(header: Path = KERNELS_H) -> dict[str, int]:
    """The `#define NAME <integer>` lines of `header`: the limits C and Python share (ops.py reads them from here)."""
    pattern = re.compile(r"^#define\s+(\w+)\s+(\d+)\s*$", re.MULTILINE)
    return {name: int(value) for name, value in pattern.findall(header.read_text())}


def cpu_flags() -> bytes:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where there is no /proc/cpuinfo)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags"))
    except (OSError, StopIteration):
        return b""


def cache_key(compiler: Compiler, openmp: bool, march: str = "native") -> str:
    """A hash of everything the build's machine code depends on; each part length-prefixed so none runs into the
    next."""
    parts = [source.read_bytes() for source in SOURCES + HEADERS]
    parts += [" ".join(FLAGS).encode(), march.encode(), compiler.path.encode(), compiler.version.encode()]
    parts += [b"openmp" if openmp else b"no-openmp", platform.machine().encode(), cpu_flags()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:16]


def library_name(compiler: Compiler, openmp: bool) -> str:
    return f"kernels-{cache_key(compiler, openmp)}-{'openmp' if openmp else 'serial'}.so"


def compile_kernels(
    target: Path, march: str = "native", openmp: bool | None = None, compiler: Compiler | None = None
) -> bool:
    """Compiles the kernels into `target` for the CPU `march` names, with OpenMP if `openmp` (by default: where the
    compiler has it). Returns whether OpenMP is linked in; raises NoCompiler, or CalledProcessError."""
    compiler = compiler or Compiler.find()
    if compiler is None:
        raise NoCompiler("no C compiler: set CC, or put cc or gcc on PATH")
    if openmp is None:
        openmp = compiler.has_openmp(target.parent)
    command = [compiler.command, *FLAGS, f"-march={march}", *(["-fopenmp"] if openmp else [])]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".objects-") as scratch:
        # one compiler per source, all at once (a first start waits on this), then one link
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        running = [
            subprocess.Popen([*command, "-c", str(source), "-o", str(obj)], stderr=subprocess.PIPE)
            for source, obj in zip(SOURCES, objects)
        ]
        errors = [process.communicate()[1] for process in running]  # every compiler waited for, then judged
        for process, error in zip(running, errors):
            if process.returncode:
                raise subprocess.CalledProcessError(process.returncode, process.args, stderr=error)
        subprocess.run([*command, "-o", str(target), *map(str, objects), "-lm"], check=True, capture_output=True)
    return openmp


def load(path: Path) -> ctypes.CDLL:
    """A compiled kernel library, its functions given their C signatures."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def default_directory() -> Path:
    return Path(platformdirs.user_cache_dir("tokenmill")) / "kernels"


def private_directory(path: Path) -> Path:
    """`path`, created 0700 if missing, once it is safe to build in and load from: a real directory (not a symlink),
    the current user's, and writable by no one else. Raises UnsafeCache otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode went through the umask
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeCache(f"{path} is a symbolic link or not a directory")
    _check_owned(path, info)
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # ours, and others could only read it: nothing planted, so tighten it
    return path


def _check_owned(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise UnsafeCache(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    if info.st_mode & 0o022:
        raise UnsafeCache(f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})")


def check_library_file(path: Path) -> None:
    """Raises UnsafeCache unless `path` is a regular file (not a symlink) of the current user's that no one else can
    write."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeCache(f"{path} is a symbolic link or not a regular file")
    _check_owned(path, info)


def cached_build(directory: Path, compiler: Compiler) -> tuple[Path, bool]:
    """This CPU's library in `directory`, compiled there first if missing, and whether it has OpenMP."""
    threaded = directory / library_name(compiler, openmp=True)
    if os.path.lexists(threaded):  # built with OpenMP by this very compiler: no need to probe again
        return threaded, True
    openmp = compiler.has_openmp(directory)
    target = directory / library_name(compiler, openmp)
    if not os.path.lexists(target):
        tmp = target.with_name(f"{target.stem}.tmp-{os.getpid()}.so")
        try:
            compile_kernels(tmp, openmp=openmp, compiler=compiler)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target, openmp


def library(directory: Path | None = None) -> ctypes.CDLL | None:
    """The kernels built for this CPU in `directory` (by default the user's cache), loaded; None where they cannot be
    (no compiler, an unsafe directory, a failed build), logged once per process with the fix."""
    compiler = Compiler.find()
    if compiler is None:
        cc = os.environ.get("CC")
        found = f"CC={cc} does not run" if cc else "neither cc nor gcc is on PATH"
        _warn_once("compiler", "no C compiler for the kernels (%s): %s. Install gcc, or set CC.", found, SLOWER)
        return None
    loaded = _load_cached(directory or default_directory(), compiler)
    if loaded is not None and not loaded[1]:
        fix = "Install a compiler with OpenMP (gcc with libgomp, or clang with libomp), or set CC to one."
        what = "the threaded kernels (int8 matmul, paged attention, argmax, gated GELU) are left out"
        _warn_once("openmp", "the C compiler %s has no OpenMP: %s and %s. %s", compiler.command, what, SLOWER, fix)
    return loaded[0] if loaded else None


def _load_cached(directory: Path, compiler: Compiler) -> tuple[ctypes.CDLL, bool] | None:
    """The cached build loaded, and whether it has OpenMP; None (logged) where it cannot be built or trusted."""
    try:
        path, openmp = cached_build(private_directory(directory), compiler)
        check_library_file(path)
        return load(path), openmp
    except UnsafeCache as e:
        fix = "Remove it, or make it a directory of your own with mode 0700."
        _warn_once("unsafe", "not building or loading the C kernels: %s; %s. %s", e, SLOWER, fix)
    except subprocess.CalledProcessError as e:
        output = (e.stderr or b"").decode(errors="replace").strip()[-2000:]
        _warn_once("build", "compiling the C kernels failed; %s. The compiler said:\n%s", SLOWER, output)
    except OSError as e:
        _warn_once("load", "the C kernels could not be built or loaded (%s); %s", e, SLOWER)
    return None


def _warn_once(topic: str, message: str, *args: object) -> None:
    if topic not in _warned:
        _warned.add(topic)
        log.warning(message, *args)
