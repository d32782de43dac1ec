"""A gated MLP's first projection and its activation, and the rows' quantisation before every product, timed alone.

python scripts/mlp_speed.py                          # the default model's and a Gemma-3-1B-shaped layer's sizes
PYTHONPATH=/path/to/other/tree python scripts/mlp_speed.py   # the same on another tree, to compare

For each (f, k) shape, Q5_0 weights (the gate and up of Gemma 3 files) in `--layers` distinct copies so that each call
streams its weights as a decode step does, it prints the median call of the rounds: gguf_matmul into (M, 2f) then
gelu_mul (two passes; ops' Python around each call included, where the C layer makes none), and gguf_matmul_gated (one
pass) where the tree has it. Then gguf_quantize_rows' best call per 32-input block at a step's row counts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch

from tokenmill.kernels import ops

SHAPES = ((2048, 640), (6912, 1152))  # (f, k): Gemma 3 270M's MLP, a Gemma-3-1B-shaped one


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not ops.gguf_matmul_available():
        raise SystemExit("no GGUF kernel on this machine")
    t = int(gguf.GGMLQuantizationType.Q5_0)
    for f, k in SHAPES:
        weights = [
            ops.gguf_repack(torch.from_numpy(gguf.quants.quantize(_normal(2 * f, k, seed), t)), t, k)
            for seed in range(args.layers)
        ]
        for m in args.rows:
            print(_mlp_line(t, f, k, m, weights, args.rounds), flush=True)
    for m, k in ((1, 6912), (16, 1152), (16, 6912)):
        print(_quantise_line(m, k), flush=True)


def _mlp_line(t: int, f: int, k: int, m: int, weights: list[torch.Tensor], rounds: int) -> str:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    products = torch.empty(m, 2 * f, dtype=torch.bfloat16)

    def two_passes(w: torch.Tensor) -> None:
        ops.gguf_matmul(x, t, w, 2 * f, products)
        ops.gelu_mul(products)

    def one_pass(w: torch.Tensor) -> None:
        ops.gguf_matmul_gated(x, t, w, f, True)

    line = f"f={f} k={k} rows={m}: two passes {_median_us(two_passes, weights, rounds):7.1f} us"
    if hasattr(ops, "gguf_matmul_gated"):  # a tree from before it: the two passes alone
        line += f", one pass {_median_us(one_pass, weights, rounds):7.1f} us"
    return line


def _quantise_line(m: int, k: int) -> str:
    x = torch.randn(m, k).bfloat16()
    best = min(_timed(lambda: ops.gguf_quantize_rows(x)) for _ in range(300))
    return f"quantise rows={m} k={k}: {best * 1e9 / (m * k / 32):5.1f} ns a block (the call's Python included)"


def _normal(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_us(call: Callable[[torch.Tensor], None], weights: list[torch.Tensor], rounds: int) -> float:
    """The median over rounds of one call's mean time, each round calling once on every copy of the weights."""
    means = [sum(_timed(functools.partial(call, w)) for w in weights) / len(weights) for _ in range(rounds)]
    return statistics.median(means) * 1e6


if __name__ == "__main__":
    main()
