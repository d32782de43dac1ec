"""One path of the engine's decode step against another, in one process, alternating step by step.

python scripts/step_alternation.py --off forward-ids        # the step from its ids in one C call, or the layer stack
python scripts/step_alternation.py --off quick-greedy       # greedy rows from a few values, or the whole pipeline
python scripts/step_alternation.py --off read-by-address    # the few logits read in place, or by a torch gather
python scripts/step_alternation.py --off head-in-call       # a lone greedy row's head in the layers' call, or its own
python scripts/step_alternation.py --off kept-output        # the step's output in a buffer kept between steps, or new
python scripts/step_alternation.py --off no-inference-mode  # the C step outside torch's inference mode, or inside
python scripts/step_alternation.py --cold-probe             # what a few torch calls cost after a weights-sized sweep

This machine's memory speed drifts by a third within minutes, so two runs compared one after the other measure the
drift as much as the change. Here every other decode step takes the path turned off; consecutive steps see the same
memory, and the median of the pairs' differences is the change's cost or gain. Greedy, the bench's logit_bias on EOS,
one stream (`--batch` for more).

`--cold-probe` times three small torch calls and a pure Python loop warm, and right after reading 200 MB (as a decode
step streams its weights): what Python's share of a step pays for caches the kernels have emptied.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenmill.config import Config
from tokenmill.engine import sampler
from tokenmill.engine.core import EngineCore
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampling import SamplingParams
from tokenmill.model.c_layer import LayerStack, StepPlan
from tokenmill.server.load import load_engine


def torch_gather(logits: torch.Tensor, at: list[int]) -> list[float]:
    return logits.reshape(-1)[torch.tensor(at, dtype=torch.long)].tolist()


def no_step_in_c(self: LayerStack, *args: Any) -> None:
    return None


def new_output(self: StepPlan, rows: int) -> tuple[torch.Tensor, int]:
    x = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
    return x, x.data_ptr()


SWITCHES: dict[str, tuple[Any, str, Callable[..., Any]]] = {  # path → (owner, attribute, its stand-in when off)
    "forward-ids": (LayerStack, "forward_ids", no_step_in_c),
    "quick-greedy": (sampler, "_greedy_by_head", lambda logits, rows: None),
    "read-by-address": (sampler, "_read_floats", torch_gather),
    "head-in-call": (EngineCore, "_lone_greedy_keep", lambda self, batch: None),
    "kept-output": (StepPlan, "output", new_output),
    "no-inference-mode": (ModelRunner, "forward", torch.inference_mode()(ModelRunner.forward)),
}


def alternate(core: EngineCore, prompts: list[list[int]], switch: str, tokens: int, ban: dict[int, float]) -> str:
    owner, name, stand_in = SWITCHES[switch]
    real = getattr(owner, name)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i, prompt in enumerate(prompts):
        core.add_request(
            f"s{i}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, logit_bias=ban)
        )
    core.step()  # the prompts
    on = False
    try:
        while core.has_work:
            on = not on
            setattr(owner, name, real if on else stand_in)
            start = time.perf_counter()
            core.step()
            times[on].append(time.perf_counter() - start)
    finally:
        setattr(owner, name, real)
    pairs = [off - on_ for on_, off in zip(times[True], times[False])]
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return (
        f"{switch}: step {ms[True]:.3f} ms on, {ms[False]:.3f} ms off; "
        f"median of (off - on) over {len(pairs)} pairs {statistics.median(pairs) * 1e3:+.3f} ms"
    )


def cold_probe() -> None:
    sweep = np.ones(200_000_000, dtype=np.uint8)
    x = torch.zeros(1, 640, dtype=torch.bfloat16)

    def python_loop() -> int:
        return sum(i * 3 for i in range(200))

    def torch_calls() -> object:
        return torch.empty_like(x), torch.tensor([1, 2, 3]), x[0:1]

    for label, fn in (("a pure Python loop", python_loop), ("three small torch calls", torch_calls)):
        warm, cold = [], []
        for _ in range(30):
            fn()
            start = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - start)
            sweep.max()  # 200 MB read: every cache level refilled with it
            start = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - start)
        print(f"{label}: {statistics.median(warm) * 1e6:.1f} us warm, {statistics.median(cold) * 1e6:.1f} us cold")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or model directory; default: the packaged model")
    parser.add_argument("--off", choices=sorted(SWITCHES), help="the path every other step goes without")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=500, help="tokens per stream (two runs)")
    parser.add_argument("--cold-probe", action="store_true")
    args = parser.parse_args()
    if args.cold_probe:
        cold_probe()
    if not args.off:
        return
    engine = load_engine(Config(model=(args.model,) if args.model else (), dtype="bfloat16", speculative="off"))
    tok = engine.tokenizer
    ban = {i: -100.0 for i in tok.eos_ids}
    prompts = [tok.encode(f"Question {i}: the capital of France is") for i in range(args.batch)]
    for _ in range(2):
        print(engine.run_in_engine_thread(lambda: alternate(engine.core, prompts, args.off, args.tokens, ban)))


if __name__ == "__main__":
    main()
