"""This machine's memory read bandwidth, and the single-stream speed limit it sets for a model file.

A single-stream decode step reads every weight once, so on a memory-bound CPU a token cannot take less time than the
bytes of weights ÷ the read bandwidth. The bench measures the bandwidth just before and just after each server's
single-stream runs, with the servers idle, and reports, per server, the share of that limit its single-stream decode
reaches for the bytes a step reads from the GGUF file, against the figures around its own runs: on a shared machine the bandwidth
drifts by the minute (by a third and more within a quarter of an hour), so a figure from another moment, let alone
another day, would not do.

The sum reads memory held as the weights are (kernels/huge_pages.py: in huge pages where the system has them), so
that the limit is what the machine gives the weights: in small pages the translations of a gigabyte cost a share of
the speed on some machines, virtual ones above all.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from tokenmill.bench.servers import cpu_cores

if TYPE_CHECKING:
    import torch

READ_BYTES = 1 << 30  # far past every cache, so the sum streams from memory
REPEATS = 5


def measure_read_gb_s(
    size_bytes: int = READ_BYTES, repeats: int = REPEATS, threads: int | None = None, over: torch.Tensor | None = None
) -> float:
    """GB/s (10⁹ bytes) of the fastest of `repeats` sums over a `size_bytes` float32 tensor, on `threads` threads
    (default: every core, as the servers run). `over`: a float32 tensor already written to sum instead, for a loop
    that measures again and again (a new one is a gigabyte of pages to back each time)."""
    import torch

    # written before timing, so that every page is backed
    x = over if over is not None else read_buffer(size_bytes)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or cpu_cores())
    try:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return x.numel() * 4 / best / 1e9


def read_buffer(size_bytes: int = READ_BYTES) -> torch.Tensor:
    """A float32 tensor of `size_bytes` for measure_read_gb_s to sum, written, in memory held as the weights are."""
    import torch

    from tokenmill.kernels import huge_pages

    x = huge_pages.empty(size_bytes // 4 * 4).view(torch.float32)
    return x.fill_(1.0)


def gguf_weight_bytes(path: str) -> int:
    """The bytes of tensor data a decode step reads from a GGUF file: every tensor once, except a token embedding
    table beside a head of its own (`output.weight`), of which a step reads one row per token (llama.cpp's
    get_rows, tokenmill's lookup); a tied table is the head and is read whole."""
    from tokenmill.model.loading.gguf_file import read_gguf_file

    _, tensors = read_gguf_file(path)
    names = {t.name for t in tensors}
    untied = "output.weight" in names
    return sum(t.data.nbytes for t in tensors if not (untied and t.name == "token_embd.weight"))


def limit_tok_s(read_gb_s: float, weight_bytes: int) -> float:
    """The single-stream decode speed at which reading the weights once per token takes all the bandwidth."""
    return read_gb_s * 1e9 / weight_bytes
