"""ik_llama.cpp's server as a peer (`--peers ik-llama-server`): a llama.cpp fork tuned for CPUs
(github.com/ikawrakow/ik_llama.cpp), with its own matmul kernels and row-interleaved weight layouts.

It is not on PyPI in any form, so the bench cannot build it the way it builds llama-server: it takes a binary built
by hand, `--ik-llama-server PATH` or TOKENMILL_IK_LLAMA_SERVER, and refuses at once, before anything is built or
started, when there is none. The server's command line is llama-server's (same threads, slots and context), plus the
two flags its CPU users add: `-rtr` repacks the weights at load into those interleaved layouts, and `-fa on` turns on
flash attention.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tokenmill.bench.llama_server import llama_server_spec
from tokenmill.bench.servers import ServerSpec, ServerStartError

NAME = "ik-llama-server"
ENV = "TOKENMILL_IK_LLAMA_SERVER"
CPU_FLAGS = ("-rtr", "-fa", "on")  # its -fa takes a value (on, off, auto)
BUILD = (
    "cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "
    "&& cmake --build build --target llama-server -j2"
)


def ik_llama_binary(given: Path | str | None) -> Path:
    """The binary named by --ik-llama-server, else by TOKENMILL_IK_LLAMA_SERVER; one line saying how to build it
    (a ServerStartError) where neither names an executable file."""
    path = given or os.environ.get(ENV)
    if path and Path(path).is_file() and os.access(path, os.X_OK):
        return Path(path)
    where = f"{path} is not an executable file" if path else f"no --ik-llama-server PATH and no {ENV}"
    raise ServerStartError(
        f"{NAME}: {where}; build it in a checkout of github.com/ikawrakow/ik_llama.cpp with `{BUILD}` "
        "and pass build/bin/llama-server"
    )


def ik_llama_server_spec(
    binary: str, port: int, model: str, threads: int, slots: int, ctx_per_slot: int, extra: list[str]
) -> ServerSpec:
    """llama-server's command line for the same slots and context, plus ik_llama.cpp's CPU flags, then `extra`."""
    spec = llama_server_spec(binary, port, model, threads, slots, ctx_per_slot, [*CPU_FLAGS, *extra])
    return dataclasses.replace(spec, name=NAME)
