"""Decode speed with a JSON-schema constraint against without, in-process on the default model (no HTTP).

python scripts/structured_speed.py --tokens 64 --rounds 3

Every request is greedy with EOS banned and the same prompt; the constrained ones follow a schema that cannot close
within the token budget (one string of at least 10,000 characters), so every step of every constrained sequence
computes and applies a grammar mask. Levels: one stream free vs constrained; 16 streams all free vs half constrained.
Rounds alternate the cases and each figure is the median, so the machine's drift mostly cancels out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.guided import GuidedState, json_schema_guide
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_engine

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 10_000}}, "required": ["story"]}


def run(core: EngineCore, prompt: list[int], params: list[SamplingParams], tag: str) -> float:
    """Generated tokens per second over the whole batch."""
    for i, p in enumerate(params):
        core.add_request(f"{tag}-{i}", prompt, p)
    start, steps, tokens = time.perf_counter(), 0, 0
    while core.has_work and steps < 20 * max(p.max_tokens for p in params):
        tokens += sum(len(d.token_ids) for out in core.step() for d in out.deltas)
        steps += 1
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = load_engine(Config(speculative="off"))  # a grammar's cost per plain step
    core, tok = engine.core, engine.tokenizer
    prompt = tok.encode('Write a story as JSON: {"story": "')
    guide = json_schema_guide(SCHEMA)
    GuidedState(guide, tok, core.runner.cfg.vocab_size)  # builds llguidance's tokenizer once, outside the timing
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, logit_bias={i: -100.0 for i in tok.eos_ids})
    constrained = dataclasses.replace(free, guide=guide)
    cases = {
        "1 stream, free": [free],
        "1 stream, JSON schema": [constrained],
        "16 streams, all free": [free] * 16,
        "16 streams, half JSON schema": [free, constrained] * 8,
    }
    figures: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, params in cases.items():
            figures[name].append(engine.run_in_engine_thread(lambda p=params, t=f"{r}{name}": run(core, prompt, p, t)))
    median = {name: statistics.median(values) for name, values in figures.items()}
    for name, value in median.items():
        print(f"{name:32s} {value:7.1f} tok/s")
    print(f"single-stream: constrained / free = {median['1 stream, JSON schema'] / median['1 stream, free']:.2f}x")
    half = median["16 streams, half JSON schema"] / median["16 streams, all free"]
    print(f"16 streams: half constrained / all free = {half:.2f}x")


if __name__ == "__main__":
    main()
