"""In-process decode speed with and without draftless speculation (no HTTP): EOS banned, 128 tokens a stream.

python scripts/speculation_speed.py                      # 1 and 4 streams, the edit and free prompts, off and ngram
python scripts/speculation_speed.py --clients 1 --workload edit --model FILE.gguf
python scripts/speculation_speed.py --temperature 0.7    # sampled (greedy by default), each stream seeded

`edit`: a function of the standard library's json module, to be written out again without its docstring (most of
the answer is in the prompt); `free`: the prompts `tokenmill bench` sends, one per stream. Each setting runs in a
process of its own, twice in a row (the first warms its caches); the second run's aggregate is printed beside the
engine's speculation counters. The outputs are the same either way (tests/e2e/test_speculation_real.py).
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time

from tokenmill.bench.load import PROMPTS

EDIT = (
    f"Here is a function:\n\n```python\n{inspect.getsource(json.dumps)[:1200]}\n```\n\n"
    "The same function with its docstring removed:\n\n```python\n"
)


def one(model: str | None, method: str, clients: int, workload: str, tokens: int, temperature: float) -> str:
    from tokenmill.config import Config
    from tokenmill.engine.sampling import SamplingParams
    from tokenmill.server.load import load_engine

    engine = load_engine(Config(model=(model,) if model else (), dtype="bfloat16", speculative=method))
    core, tok = engine.core, engine.tokenizer
    ban = {i: -100.0 for i in tok.eos_ids}

    def run() -> str:
        rates = []
        for r in range(2):
            for c in range(clients):
                prompt = EDIT if workload == "edit" else PROMPTS[(r * clients + c) % len(PROMPTS)]
                params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=c, logit_bias=ban)
                core.add_request(f"r{r}-{c}", tok.encode(prompt), params)
            start, made = time.perf_counter(), 0
            for _ in range(100_000):  # bounded: every stream ends after `tokens` tokens
                if not core.has_work:
                    break
                made += sum(len(d.token_ids) for out in core.step() for d in out.deltas)
            rates.append(made / (time.perf_counter() - start))
        st = core.snapshot_stats()
        return (
            f"{method:5s} {clients:2d} stream(s) {workload:4s}: {rates[-1]:6.1f} tok/s"
            f" (drafts {st.spec_drafts}, draft tokens {st.spec_draft_tokens}, kept {st.spec_accepted_tokens})"
        )

    return engine.run_in_engine_thread(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or model directory; default: the packaged model")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workload", nargs="+", choices=("edit", "free"), default=["edit", "free"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "CLIENTS", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        method, clients, workload = args.one
        print(one(args.model, method, int(clients), workload, args.tokens, args.temperature), flush=True)
        return
    for workload in args.workload:
        for clients in args.clients:
            for method in ("off", "ngram"):
                command = [sys.executable, __file__, "--one", method, str(clients), workload]
                command += ["--tokens", str(args.tokens), "--temperature", str(args.temperature)]
                if args.model:
                    command += ["--model", args.model]
                subprocess.run(command, check=True, timeout=1800)


if __name__ == "__main__":
    main()
