"""One engine replica's service times, in-process, as the capacity simulation takes them (cluster/sim/).

    python scripts/replica_service_times.py --threads 1          # what each of 2 replicas on 2 cores runs with
    python scripts/replica_service_times.py --model PATH --threads 4

A decode step is timed at two batch sizes (greedy, EOS banned) and fitted as t_fixed + t_per_seq x batch; a prefill
of a long prompt (no cache hits: fresh random ids) gives t_per_prefill_token once the step's fixed part is taken
off. It prints the figures and the simulator flags that carry them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_engine

PROMPT = "The capital of France is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF file or model directory; default: the packaged Gemma 3 270M")
    parser.add_argument("--threads", type=int, default=1, help="the replica's intra-op threads")
    parser.add_argument("--batch", type=int, nargs=2, default=[1, 16], help="the two decode batch sizes fitted")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed at each batch size")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill timing")
    parser.add_argument("--rounds", type=int, default=3, help="repeats of each timing (the median is kept)")
    args = parser.parse_args()
    config = Config(
        model=(args.model,) if args.model else (),
        threads=args.threads,
        max_num_batched_tokens=2048,
        speculative="off",  # the plain steps' times are what the replica model takes
    )
    engine = load_engine(config)
    core = engine.core
    ban = {i: -100.0 for i in engine.tokenizer.eos_ids}
    prompt = engine.tokenizer.encode(PROMPT)
    small, large = args.batch

    def timed(measure: Callable[[], float]) -> float:
        return statistics.median(engine.run_in_engine_thread(measure) for _ in range(args.rounds))

    t_small = timed(lambda: decode(core, prompt, small, args, ban))
    t_large = timed(lambda: decode(core, prompt, large, args, ban))
    per_seq = (t_large - t_small) / (large - small)
    fixed = t_small - per_seq * small
    t_prefill = timed(lambda: prefill(core, args.prefill_tokens))
    per_token = max(t_prefill - fixed, 0.0) / args.prefill_tokens
    print(f"model {engine.model_name}, {args.threads} thread(s)")
    print(f"decode step: batch {small} {t_small * 1e3:.2f} ms, batch {large} {t_large * 1e3:.2f} ms")
    print(f"prefill of {args.prefill_tokens} tokens: {t_prefill * 1e3:.1f} ms")
    print(f"--t-fixed {fixed:.5f} --t-per-seq {per_seq:.6f} --t-per-prefill-token {per_token:.6f}")


def decode(core: EngineCore, prompt: list[int], batch: int, args: argparse.Namespace, ban: dict[int, float]) -> float:
    """Mean seconds of a decode step with `batch` sequences running (their prefill and first steps not timed)."""
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, logit_bias=ban)
    for i in range(batch):
        core.add_request(f"decode-{batch}-{time.monotonic_ns()}-{i}", prompt, params)
    for _ in range(4):  # prefill, then a few steps so every sequence is decoding
        core.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    elapsed = (time.perf_counter() - start) / args.steps
    _drain(core)
    return elapsed


def prefill(core: EngineCore, tokens: int) -> float:
    """Seconds of the one step that prefills a `tokens`-long prompt of fresh ids (nothing in the prefix cache)."""
    rng = random.Random(time.monotonic_ns())
    ids = [rng.randrange(1000, 20000) for _ in range(tokens)]
    core.add_request(f"prefill-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    core.step()
    elapsed = time.perf_counter() - start
    _drain(core)
    return elapsed


def _drain(core: EngineCore) -> None:
    for _ in range(10_000):
        if not core.has_work:
            return
        core.step()


if __name__ == "__main__":
    main()
