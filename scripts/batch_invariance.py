"""Seeds under load, in-process and fast: tests/e2e/test_seeds_under_load.py's requests (tests/e2e/seeds_workload.py)
without HTTP, their arrivals spread over the engine's steps so that each round's steps hold other mixes of prefills
and decodes.

python scripts/batch_invariance.py --rounds 100
python scripts/batch_invariance.py --model path/to/file.gguf --rounds 30 --start 16

A seeded sampling request and a greedy one run alone, then in every round among 14 filler requests (prompts and
lengths that change from round to round, some seeded, some greedy), each request arriving at a random step. Each
round's seeded and greedy outputs must equal their runs alone, tokens and cumulative logprob, bit for bit; a round that
differs is printed with its text. The e2e tier catches a fault of this kind only when the server's timing happens to
make the batch that shows it (one such fault showed only in a 65-row step, and failed 2 tier runs in 4); here a
round is deterministic, and `--start N` replays round N on a fresh engine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the requests live with the e2e tests

from tests.e2e.seeds_workload import GREEDY, SEEDED, fillers
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.sequence import Sequence
from tokenmill.server.load import load_engine_core

SPREADS = [0, 1, 3, 8, 20]  # a round's arrivals fall on steps 0..spread
MAX_STEPS = 5000  # per round: far more than 16 requests of at most 32 tokens need


@dataclass(frozen=True)
class Arrival:
    step: int
    name: str
    body: dict[str, Any]  # an OpenAI completion request's: the prompt and the sampling fields


def run(core: EngineCore, arrivals: list[Arrival]) -> dict[str, Sequence]:
    """Adds each request at its step and steps until all are done; returns each one's sequence."""
    pending = sorted(arrivals, key=lambda a: a.step)
    sequences: dict[str, Sequence] = {}
    for step in range(MAX_STEPS):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            request_id = f"{a.name}-{time.monotonic_ns()}"
            params = {k: v for k, v in a.body.items() if k != "prompt"}
            core.add_request(request_id, core.tokenizer.encode(a.body["prompt"]), SamplingParams(logprobs=0, **params))
            sequences[a.name] = core.requests[request_id].seqs[0]
        if not pending and not core.has_work:
            return sequences
        core.step()
    raise RuntimeError(f"the round did not finish in {MAX_STEPS} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model directory; default: the packaged model")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--start", type=int, default=0, help="the first round (rounds are numbered as if from 0)")
    args = parser.parse_args()
    core = load_engine_core(Config(model=(args.model,) if args.model else ())).core
    decode = core.tokenizer.decode
    alone = {
        name: run(core, [Arrival(0, name, body)])[name] for name, body in {"seeded": SEEDED, "greedy": GREEDY}.items()
    }
    want = {name: (seq.output_ids, seq.cumulative_logprob) for name, seq in alone.items()}
    for name, (ids, _) in want.items():
        print(f"{name} alone: {decode(ids)!r}")
    differ, started = 0, time.perf_counter()
    for r in range(args.start, args.start + args.rounds):
        items = [("seeded", SEEDED), ("greedy", GREEDY), *((f"filler{i}", f) for i, f in enumerate(fillers(r)))]
        rng = random.Random(1000 + r)
        rng.shuffle(items)
        spread = rng.choice(SPREADS)
        got = run(core, [Arrival(rng.randint(0, spread), name, body) for name, body in items])
        for name in ("seeded", "greedy"):
            seq = got[name]
            if (seq.output_ids, seq.cumulative_logprob) != want[name]:
                differ += 1
                print(f"round {r} (arrivals over {spread + 1} steps): {name} differs: {decode(seq.output_ids)!r}")
    print(f"{args.rounds} rounds, {differ} outputs differ from alone, {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
