"""In-process decode speed of the engine (no HTTP): greedy, EOS banned, a batch of prompts decoded together.

python scripts/engine_speed.py --dtype bfloat16 --batch 1 16 --tokens 64
python scripts/engine_speed.py --batch 16 --bench-prompts --busy 0.3 1.5   # beside a process busy 0.3 ms in 1.8
python scripts/engine_speed.py --batch 1 --context 2000    # decoding after a 2,000-token prompt
python scripts/engine_speed.py --batch 16 --context 2000 --kv-cache-dtype int8 --kv-cache-mb 1024  # an 8-bit KV cache
python scripts/engine_speed.py --batch 1 --no-greedy-head   # a lone greedy row's head read whole, not from its copy

Besides the aggregate it prints where a step goes, as medians over the decode steps: the model's layers (the
runner's forward), the LM head (the runner's logits_summarised: a GGUF head's pass finds each row's argmax and
checks it finite as well) and the rest (sampling, bookkeeping), and the first step's time (the batch's prefill); and
the step's time outside the C kernels' calls (Python's and torch's share). A lone greedy row's head runs in the
layers' C call (runner.forward's greedy_keep): there "layers" holds the head and "head" is 0.
`--bench-prompts` takes the prompts `tokenmill bench` sends, one per row, in place of one repeated prompt. `--busy ON OFF` measures beside a process that spins ON ms then sleeps OFF ms (bench/busy.py), as
the server's event loop or a client on the same cores takes a core for a while.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

from tokenmill.bench.busy import busy_process
from tokenmill.bench.load import PROMPTS
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.kernels import ops
from tokenmill.server.load import load_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or model directory; default: the packaged model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--bench-prompts", action="store_true", help="the bench's prompts, one per row")
    parser.add_argument("--context", type=int, help="each prompt's tokens repeated to this many (a long context)")
    parser.add_argument("--no-amx", action="store_true", help="gguf_matmul without its AMX path (the same bits)")
    parser.add_argument("--no-greedy-head", action="store_true", help="no 6-bit copy of a Q8_0 head (the same tokens)")
    parser.add_argument("--busy", type=float, nargs=2, metavar=("ON_MS", "OFF_MS"), help="a busy process beside")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or int8")
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    args = parser.parse_args()
    if args.no_amx:
        ops.gguf_amx(False)
    engine = load_engine(
        Config(
            model=(args.model,) if args.model else (),
            dtype=args.dtype,
            quantization=args.quantization,
            greedy_head=not args.no_greedy_head,
            speculative="off",  # the plain decode step is what this times
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_mb=args.kv_cache_mb,
            kv_cache_ram_gb=0,
        )
    )
    core, tok = engine.core, engine.tokenizer
    texts = PROMPTS if args.bench_prompts else ("The capital of France is",)
    prompts = [tok.encode(text) for text in texts]
    if args.context:
        prompts = [(p * (args.context // len(p) + 1))[: args.context] for p in prompts]
    ban_eos = {i: -100.0 for i in tok.eos_ids}
    phases = Phases(core)
    with busy_process(*args.busy) if args.busy else contextlib.nullcontext():
        for batch in args.batch:
            print(engine.run_in_engine_thread(lambda b=batch: measure(core, phases, prompts, b, args.tokens, ban_eos)))


class Phases:
    """Times the runner's forward and logits calls, step by step, and every call into the C kernels' library: what a
    step spends outside them is Python's (and torch's) share."""

    def __init__(self, core: EngineCore) -> None:
        self.forward: list[float] = []
        self.logits: list[float] = []
        self.in_c: list[float] = []
        core.runner.forward = self._timed(core.runner.forward, self.forward)  # type: ignore[method-assign]
        timed_head = self._timed(core.runner.logits_summarised, self.logits)
        core.runner.logits_summarised = timed_head  # type: ignore[method-assign]
        lib = ops.library()
        if lib is not None:  # each function ctypes has looked up so far is an attribute of the library object
            for name, fn in list(vars(lib).items()):
                if isinstance(fn, ctypes._CFuncPtr):
                    setattr(lib, name, self._timed(fn, self.in_c))

    @staticmethod
    def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args)
            into.append(time.perf_counter() - start)
            return result

        return timed

    def clear(self) -> None:
        self.forward.clear()
        self.logits.clear()
        self.in_c.clear()


def measure(
    core: EngineCore,
    phases: Phases,
    prompts: list[list[int]],
    batch: int,
    tokens: int,
    ban_eos: dict[int, float],
) -> str:
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, logit_bias=ban_eos)
        core.add_request(f"{batch}-{i}-{time.monotonic_ns()}", prompts[i % len(prompts)], params)
    start = time.perf_counter()
    core.step()
    prefill = time.perf_counter() - start
    phases.clear()
    steps: list[float] = []
    outside: list[float] = []  # each step's time outside the C kernels
    while core.has_work and len(steps) < 10 * tokens:
        at = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - at)
        outside.append(steps[-1] - sum(phases.in_c))
        phases.in_c.clear()
    elapsed = time.perf_counter() - start

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3 if values else 0.0

    step, layers, head = ms(steps), ms(phases.forward), ms(phases.logits)
    return (
        f"batch={batch} aggregate={batch * tokens / elapsed:.1f} tok/s prefill step {prefill * 1e3:.1f} ms; "
        f"decode step {step:.2f} ms: layers {layers:.2f}, head {head:.2f}, rest {step - layers - head:.2f}; "
        f"outside the C kernels {ms(outside):.2f}"
    )


if __name__ == "__main__":
    main()
