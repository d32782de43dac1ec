"""paged_attention's speed at a decode step's shapes: each row one new query over `count` cached keys.

python scripts/attention_speed.py                      # the default model's heads, and a Llama 3.2 1B's
python scripts/attention_speed.py --rows 1 --count 1000 --heads 4 1 256

For each shape it prints the best of the rounds in microseconds and in G multiply-adds/s (q . k and p . v, both
counted). The keys sit in blocks of 16 slots in random order, as a paged cache scatters a sequence's blocks; at the
default sizes the whole cache fits in the CPU's caches, so this is the kernel's compute, not memory.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import ops

SHAPES = ((4, 1, 256), (32, 8, 64))  # (query heads, KV heads, head size): Gemma 3 270M, Llama 3.2 1B
BLOCK = 16  # the KV cache's slots per block (Config.block_size's default)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--count", type=int, nargs="+", default=[64, 200])
    parser.add_argument("--heads", type=int, nargs=3, metavar=("HQ", "HKV", "D"), help="one shape instead of both")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not ops.paged_attention_available():
        raise SystemExit("no native attention kernel on this machine")
    shapes = [tuple(args.heads)] if args.heads else SHAPES
    for hq, hkv, d in shapes:
        for rows in args.rows:
            for count in args.count:
                seconds = best_call(rows, hq, hkv, d, count, args.rounds)
                macs = 2 * rows * hq * count * d
                print(
                    f"rows={rows:3d} heads={hq}/{hkv} d={d:3d} keys={count:5d}: "
                    f"{seconds * 1e6:8.1f} us  {macs / seconds / 1e9:6.1f} G MAC/s",
                    flush=True,
                )


def best_call(rows: int, hq: int, hkv: int, d: int, count: int, rounds: int, calls: int = 100) -> float:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(rows * count, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(rows * count, hkv, d, generator=gen).bfloat16()
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    blocks = torch.randperm(-(-rows * count // BLOCK), generator=gen)  # a paged cache: blocks in any order
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[: rows * count]
    offset, counts = torch.arange(rows) * count, torch.full((rows,), count)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            ops.paged_attention(q, k_cache, v_cache, slots, offset, counts, d**-0.5)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


if __name__ == "__main__":
    main()
