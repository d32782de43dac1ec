"""The engine's decode step with LoRA adapters and without, in process (no HTTP): one stream, and `--clients` streams
spread over the adapters, against the same without adapters, on one engine that has them loaded.

    python scripts/lora_speed.py [--model FILE] [--adapters 4] [--rank 16] [--clients 16] [--tokens 48]

Random adapters over every linear of every layer (tokenmill/bench/lora.py), written under a temporary folder. Each
figure is the mean step time of the decode steps after every prompt is in; the pairs run in turn, twice, so that a
drift of the machine's speed falls on both.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.bench.lora import write_random_adapter
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.model.loading.loader import load_model_files
from tokenmill.server.load import load_engine_core

PROMPT = [2, *range(1000, 1030)]


def step_ms(core: EngineCore, adapters: list[str | None], tokens: int) -> float:
    """The mean decode step (ms) of one request per entry of `adapters`, once every prompt is in."""
    for i, adapter in enumerate(adapters):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, adapter=adapter)
        core.add_request(f"{time.monotonic_ns()}-{i}", PROMPT, params)
    for _ in range(100):  # the prefills
        if all(s.num_computed_tokens >= len(PROMPT) for state in core.requests.values() for s in state.seqs):
            break
        core.step()
    started, steps = time.perf_counter(), 0
    while core.has_work and steps < 10 * tokens:
        core.step()
        steps += 1
    return (time.perf_counter() - started) / max(steps, 1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF file (default: the packaged Gemma 3 270M)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    config = load_model_files(args.model, None, torch.bfloat16, "gguf").config
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(Path(tmp) / f"a{i}", config, args.rank, i) for i in range(args.adapters)]
        lora = tuple(f"a{i}={path}" for i, path in enumerate(paths))
        model = (args.model,) if args.model else ()
        core = load_engine_core(Config(model=model, lora=lora, speculative="off")).core
        spread = [f"a{i % args.adapters}" for i in range(args.clients)]
        cases = {
            "1 stream": [None],
            "1 stream, adapter": ["a0"],
            f"{args.clients} streams": [None] * args.clients,
            f"{args.clients} streams over {args.adapters} adapters": spread,
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(2):
            for name, adapters in cases.items():
                times[name].append(step_ms(core, adapters, args.tokens))
    for name, found in times.items():
        print(f"{name:36s} {' '.join(f'{t:7.2f}' for t in found)} ms a step")
    names = list(times)
    for plain, adapted in ((names[0], names[1]), (names[2], names[3])):
        ratio = sum(times[plain]) / sum(times[adapted])
        print(f"{adapted}: {ratio:.2f}x the speed of {plain}")


if __name__ == "__main__":
    main()
