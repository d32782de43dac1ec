"""In-process decode speed of the engine (no HTTP): greedy, EOS banned, a batch of identical prompts.

python scripts/engine_speed.py --dtype bfloat16 --batch 1 16 --tokens 64
"""

from __future__ import annotations

import argparse
import time

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engine = AsyncEngine.from_config(Config(dtype=args.dtype, quantization=args.quantization))
    core, tok = engine.core, engine.tokenizer
    prompt = tok.encode("The capital of France is")
    ban_eos = {i: -100.0 for i in tok.eos_ids}
    for batch in args.batch:
        print(engine.run_in_engine_thread(lambda b=batch: measure(core, prompt, b, args.tokens, ban_eos, args)))


def measure(
    core: EngineCore, prompt: list[int], batch: int, tokens: int, ban_eos: dict[int, float], args: argparse.Namespace
) -> str:
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, logit_bias=ban_eos)
        core.add_request(f"{batch}-{i}", prompt, params)
    start, steps = time.perf_counter(), 0
    while core.has_work and steps < 10 * tokens:
        core.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return (
        f"dtype={args.dtype} quantization={args.quantization} batch={batch} steps={steps} "
        f"aggregate={batch * tokens / elapsed:.1f} tok/s"
    )


if __name__ == "__main__":
    main()
