"""paged_attention's speed at a decode step's shapes: each row one new query over `count` cached keys.

python scripts/attention_speed.py                      # the default model's heads, and a Llama 3.2 1B's
python scripts/attention_speed.py --cold               # as a decode step finds the cache: not in the CPU's caches
python scripts/attention_speed.py --rows 1 --count 1000 --heads 4 1 256
python scripts/attention_speed.py --rows 512 --count 4000 --heads 12 2 128 --prompt   # a prefill chunk's rows

For each shape it prints the best of the rounds in microseconds per call and in G multiply-adds/s (q . k and p . v,
both counted). The keys sit in blocks of 16 slots in random order, as a paged cache scatters a sequence's blocks.
Hot (the default), one cache is attended over again and again: at the default sizes it stays in the CPU's caches, so
this is the kernel's compute. `--cold` attends over 18 caches in turn (a layer's each, as a step's layers do) after
writing 96 MiB elsewhere, so every row comes from memory as in a decode step, which streams all the weights between
two visits of a layer.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import ops

SHAPES = ((4, 1, 256), (32, 8, 64))  # (query heads, KV heads, head size): Gemma 3 270M, Llama 3.2 1B
BLOCK = 16  # the KV cache's slots per block (Config.block_size's default)
LAYERS = 18  # --cold: caches attended over in turn (Gemma 3 270M's layers)
EVICT_BYTES = 96 << 20  # --cold: written between passes, three times a 32 MiB L3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--count", type=int, nargs="+", default=[64, 200])
    parser.add_argument("--heads", type=int, nargs=3, metavar=("HQ", "HKV", "D"), help="one shape instead of both")
    parser.add_argument("--cold", action="store_true", help="every row from memory, as a decode step finds them")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--prompt", action="store_true", help="the rows are a prompt's last ones: row i sees one key more than i - 1"
    )
    args = parser.parse_args()
    if not ops.paged_attention_available():
        raise SystemExit("no native attention kernel on this machine")
    shapes = [tuple(args.heads)] if args.heads else SHAPES
    for hq, hkv, d in shapes:
        for rows in args.rows:
            for count in args.count:
                seconds = best_call(rows, hq, hkv, d, count, args.rounds, args.cold, args.prompt)
                macs = 2 * hq * d * (rows * count - (rows * (rows - 1) // 2 if args.prompt else 0))
                print(
                    f"rows={rows:3d} heads={hq}/{hkv} d={d:3d} keys={count:5d}{' cold' if args.cold else ''}"
                    f"{' prompt' if args.prompt else ''}: "
                    f"{seconds * 1e6:8.1f} us  {macs / seconds / 1e9:6.1f} G MAC/s",
                    flush=True,
                )


def best_call(rows: int, hq: int, hkv: int, d: int, count: int, rounds: int, cold: bool, prompt: bool) -> float:
    """The best round's mean call: hot, 100 calls on one cache; cold, one call on each of LAYERS caches. `prompt`: the
    rows are one sequence's last `rows` positions of `count` (the last row sees all), as a prefill's chunk is."""
    gen = torch.Generator().manual_seed(0)
    caches = [
        (
            torch.randn(rows * count, hkv, d, generator=gen).bfloat16(),
            torch.randn(rows * count, hkv, d, generator=gen).bfloat16(),
        )
        for _ in range(LAYERS if cold else 1)
    ]
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    blocks = torch.randperm(-(-rows * count // BLOCK), generator=gen)  # a paged cache: blocks in any order
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[: rows * count]
    offset, counts = torch.arange(rows) * count, torch.full((rows,), count)
    if prompt:
        offset, counts = torch.zeros(rows, dtype=torch.long), torch.arange(count - rows + 1, count + 1)
    elsewhere = torch.zeros(EVICT_BYTES if cold else 0, dtype=torch.uint8)
    calls = LAYERS if cold else 100
    best = float("inf")
    for _ in range(rounds):
        elsewhere.add_(1)  # cold: the caches' rows out of the CPU's caches
        start = time.perf_counter()
        for i in range(calls):
            k_cache, v_cache = caches[i % len(caches)]
            ops.paged_attention(q, k_cache, v_cache, slots, offset, counts, d**-0.5)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


if __name__ == "__main__":
    main()
