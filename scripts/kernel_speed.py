"""gguf_matmul's speed on a GGUF file's own tensors, with and without its AMX path, in interleaved rounds.

python scripts/kernel_speed.py --rows 16 64 [--model FILE] [--tensor token_embd.weight --columns 65536]
python scripts/kernel_speed.py --rows 16 --busy 0.4 2    # beside a process busy 0.4 ms in every 2.4 ms
python scripts/kernel_speed.py --cold --rows 1 --model FILE --tensor ffn_down.weight token_embd.weight --seconds 120

For each tensor and row count it prints the best of the rounds in G multiply-adds/s, VNNI (AMX off) then AMX, and
checks that both gave the same bits. `--columns` keeps the first N output columns of each tensor: a few thousand
stay in the caches (the kernel's compute), the whole head streams from memory. `--busy ON OFF` runs a second process
that spins ON ms then sleeps OFF ms, as a server's event loop or a client on the same cores takes a core for a while;
the figures are then the median call's, as the best round would be the one it happened to miss.

`--cold` reads each named tensor of every layer in turn (`ffn_down.weight`: blk.0's, blk.1's, ...), as a decode step
finds them, from memory, for `--seconds`, and measures the memory's read speed (bench/bandwidth.py's float32 sum) just
before and after each round: this machine's bandwidth drifts by a third and more within minutes, so each round is
reported against its own. It prints the kernel's GB/s of weights and the sum's, the median of the rounds in which the
memory was fast (both sums ≥ 45 GB/s) and of the others.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import gguf
import torch

from tokenmill.bench.bandwidth import measure_read_gb_s, read_buffer
from tokenmill.bench.busy import busy_process
from tokenmill.kernels import huge_pages, ops
from tokenmill.model.loading.loader import cache_root, packaged_gguf

TENSORS = ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file; default: the packaged model")
    parser.add_argument("--tensor", nargs="+", default=list(TENSORS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 147])
    parser.add_argument("--columns", type=int, default=4096, help="the first N output columns of each tensor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=float, nargs=2, metavar=("ON_MS", "OFF_MS"), help="a busy process beside")
    parser.add_argument("--cold", action="store_true", help="every layer's tensor in turn, from memory")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long --cold measures")
    args = parser.parse_args()
    with busy_process(*args.busy) if args.busy else contextlib.nullcontext():
        cold(args) if args.cold else run(args)


def run(args: argparse.Namespace) -> None:
    if not ops.gguf_matmul_available():
        raise SystemExit("gguf_matmul is not built here")
    amx = ops.gguf_amx()
    print(f"AMX {'available' if amx else 'not available: both columns are VNNI'}")
    reader = gguf.GGUFReader(args.model or str(packaged_gguf(cache_root(None))))
    tensors = {t.name: t for t in reader.tensors}
    for name in args.tensor:
        t = tensors[name]
        raw = torch.from_numpy(t.data[: args.columns].copy())
        n, k, kind = raw.shape[0], int(t.shape[0]), int(t.tensor_type)
        packed = ops.gguf_repack(raw, kind, k)
        for m in args.rows:
            rates, outs = measure(packed, kind, n, k, m, args.rounds, amx, median=args.busy is not None)
            same = torch.equal(outs[0], outs[1])
            print(
                f"{name:26s} {t.tensor_type.name:5s} n={n:6d} k={k:5d} rows={m:4d}: "
                f"VNNI {rates[0]:5.0f}  AMX {rates[1]:5.0f} G MAC/s" + ("" if same else "  THE BITS DIFFER"),
                flush=True,
            )
    ops.gguf_amx(amx)


FAST_GB_S = 45.0  # a round whose sums both reach this ran while the memory was fast


def cold(args: argparse.Namespace) -> None:
    """Each named tensor of every layer (or the one tensor of that name) once per round, rows × its columns, from
    memory; the float32 sum's read speed just before and after each round."""
    reader = gguf.GGUFReader(args.model or str(packaged_gguf(cache_root(None))))
    weights, arena = [], huge_pages.Arena()  # held as a model holds them (model/gguf_linear.py's Regrouping)
    for t in reader.tensors:
        if any(t.name == name or t.name.endswith("." + name) for name in args.tensor):
            raw = torch.from_numpy(t.data.copy())
            n, k, kind = raw.shape[0], int(t.shape[0]), int(t.tensor_type)
            weights.append((ops.gguf_repack(raw, kind, k, arena.empty(ops.gguf_packed_bytes(kind, n, k))), kind, n, k))
    if not weights:
        raise SystemExit(f"no tensor named {args.tensor}")
    total = sum(w.numel() for w, *_ in weights)
    inputs = {
        k: torch.randn(args.rows[0], k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        for *_, k in weights
    }
    outs = {n: torch.empty(args.rows[0], n) for _, _, n, _ in weights}
    rounds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # fast memory → (kernel, sum) GB/s
    summed = read_buffer()  # the sum's tensor, written once
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        before = measure_read_gb_s(repeats=1, over=summed)
        start = time.perf_counter()
        for w, kind, n, k in weights:
            ops.gguf_matmul(inputs[k], kind, w, n, outs[n])
        kernel = total / (time.perf_counter() - start) / 1e9
        after = measure_read_gb_s(repeats=1, over=summed)
        rounds[min(before, after) >= FAST_GB_S].append((kernel, (before + after) / 2))
    print(f"{len(weights)} tensors, {total / 1e6:.0f} MB of weights, rows={args.rows[0]}")
    for fast, found in rounds.items():
        if found:
            kernel, memory = (statistics.median(r[i] for r in found) for i in (0, 1))
            print(
                f"memory {'fast' if fast else 'slow'} ({len(found)} rounds): kernel {kernel:.1f} GB/s, "
                f"float32 sum {memory:.1f} GB/s ({kernel / memory:.0%})"
            )


def measure(
    packed: torch.Tensor, kind: int, n: int, k: int, m: int, rounds: int, amx: bool, median: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    """Rate of each path over interleaved rounds, each round ~0.1 G multiply-adds (at least 3 calls): the best
    round's mean call, or with `median` the median call of all rounds."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    outs = [torch.empty(m, n), torch.empty(m, n)]
    calls = max(3, int(1e8 / (m * n * k)))
    times: list[list[float]] = [[], []]
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, on in enumerate((False, amx)):
            ops.gguf_amx(on)
            ops.gguf_matmul(x, kind, packed, n, outs[i])
            start = last = time.perf_counter()
            for _ in range(calls):
                ops.gguf_matmul(x, kind, packed, n, outs[i])
                now = time.perf_counter()
                times[i].append(now - last)  # each call's own time
                last = now
            best[i] = min(best[i], (last - start) / calls)
    seconds = [statistics.median(t) for t in times] if median else best
    return [m * n * k / s / 1e9 for s in seconds], outs


if __name__ == "__main__":
    main()
