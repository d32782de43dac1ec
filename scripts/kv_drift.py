"""How far an 8-bit KV cache moves echo-scored logprobs, measured against the 16-bit cache and against float32.

python scripts/kv_drift.py [--model FILE] [--tokens 2000]

Each prompt token's logprob (prompt_logprobs, as evaluation harnesses score text with echo), over the first
`--tokens` tokens of README.md repeated as needed; prefill runs in the engine's chunks, so later chunks read the
earlier ones' keys and values from the cache, as they do when serving. Four engines score the text: the served
dtype (bf16) with its own cache and with `--kv-cache-dtype int8`, and float32 likewise. Prints, for each pair, the
mean, median and largest |Δ logprob| and how often the most likely token changed:

- int8 against bf16, both in bf16: what a user of the default dtype sees change. Its floor is the bf16 pipeline's own
  rounding: any change to the cached numbers, however small, sends every later bf16 rounding its own way.
- bf16 against float32, and bf16 with int8 against float32: the error each cache leaves beside the exact sums.
- int8 against float32, both in float32: the 8-bit cache's own error, with no bf16 rounding around it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tokenmill.config import Config
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_engine

TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()

Scores = tuple[list[float], list[int]]  # each prompt token's logprob after the first; the rank-1 token there


def scored(model: str | None, dtype: str, kv_cache_dtype: str, tokens: int) -> Scores:
    config = Config(
        model=(model,) if model else (),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        speculative="off",
        kv_cache_ram_gb=0,
    )
    engine = load_engine(config)
    core = engine.core
    ids = engine.tokenizer.encode(TEXT * (tokens // 500 + 1))[:tokens]

    def run() -> Scores:
        core.add_request("score", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        prompt = None
        while core.has_work:
            for out in core.step():
                prompt = out.prompt_logprobs or prompt
        assert prompt is not None
        entries = prompt[1:]
        return [e.logprob for e in entries], [e.top[0][0] if e.top else -1 for e in entries]

    return engine.run_in_engine_thread(run)


def compare(label: str, a: Scores, b: Scores) -> None:
    drift = [abs(x - y) for x, y in zip(a[0], b[0], strict=True)]
    changed = sum(x != y for x, y in zip(a[1], b[1], strict=True))
    print(
        f"{label}: mean |Δ logprob| {statistics.fmean(drift):.4f}, median {statistics.median(drift):.4f},"
        f" max {max(drift):.3f}; most likely token changed at {changed / len(drift):.1%} of {len(drift)} tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file; default: the packaged model")
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    runs = {
        (dtype, kv): scored(args.model, dtype, kv, args.tokens)
        for dtype in ("bfloat16", "float32")
        for kv in ("auto", "int8")
    }
    exact = runs["float32", "auto"]
    compare("int8 KV vs bf16 KV, in bf16      ", runs["bfloat16", "int8"], runs["bfloat16", "auto"])
    compare("bf16 KV in bf16 vs float32       ", runs["bfloat16", "auto"], exact)
    compare("int8 KV in bf16 vs float32       ", runs["bfloat16", "int8"], exact)
    compare("int8 KV vs float32 KV, in float32", runs["float32", "int8"], exact)


if __name__ == "__main__":
    main()
