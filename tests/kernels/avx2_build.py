"""The kernels compiled for AVX2 only (-march=haswell), to hold their AVX2 paths equal to the native ones."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from tokenmill.kernels import build

RUNS_HERE = {b"avx2", b"fma", b"f16c"} <= set(build.cpu_flags().split())


def avx2_library(directory: Path, kernel: str) -> ctypes.CDLL:
    """The AVX2 build, or a skip: no compiler for -march=haswell, or `kernel` not compiled in (no OpenMP)."""
    target = directory / "avx2.so"
    try:
        build.compile_kernels(target, march="haswell")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no compiler that builds for -march=haswell")
    lib = build.load(target)
    if not getattr(lib, f"{kernel}_available")():
        pytest.skip(f"no OpenMP: {kernel} is not compiled in")
    return lib
