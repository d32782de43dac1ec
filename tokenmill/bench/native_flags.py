"""The compiler flags of both llama.cpp builds the bench makes (llama-server, and llama-cpp-python for its server):
native for this CPU, minus AMX on x86-64.

This llama.cpp's AMX matmul faults (SIGILL at `tilezero` in tinygemm_kernel_amx, under OpenMP) on CPUs that report
AMX, on the first decode; its AVX-512/AVX2 paths are what most CPUs run.
"""

from __future__ import annotations

import platform

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def on_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def peer_cmake_args() -> str:
    """CMAKE_ARGS for llama-cpp-python's build of the same llama.cpp: native flags, minus AMX on x86-64."""
    if not on_x86():
        return "-DGGML_NATIVE=ON"
    return f'-DGGML_NATIVE=ON -DCMAKE_C_FLAGS="{NO_AMX}" -DCMAKE_CXX_FLAGS="{NO_AMX}"'
