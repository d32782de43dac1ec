"""How far an 8-bit KV cache moves echo-scored logprobs from the 16-bit cache's, on the same model and text.

python scripts/kv_drift.py [--model FILE] [--tokens 2000]

Each prompt token's logprob (prompt_logprobs, as evaluation harnesses score text with echo) from the engine with
`--kv-cache-dtype auto` (the model's bf16) and with `int8`, over the first `--tokens` tokens of README.md repeated
as needed; prefill runs in the engine's chunks, so later chunks read the earlier ones' keys and values from the cache,
as they do when serving. Prints the mean and largest |Δ logprob| and how often the most likely token changed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tokenmill.config import Config
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_engine

TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def scored(model: str | None, kv_cache_dtype: str, tokens: int) -> tuple[torch.Tensor, list[int]]:
    """(each prompt token's logprob after the first, the rank-1 token at each position)"""
    engine = load_engine(
        Config(model=(model,) if model else (), kv_cache_dtype=kv_cache_dtype, speculative="off", kv_cache_ram_gb=0)
    )
    core = engine.core
    ids = engine.tokenizer.encode(TEXT * (tokens // 500 + 1))[:tokens]

    def run() -> tuple[torch.Tensor, list[int]]:
        core.add_request("score", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        prompt = None
        while core.has_work:
            for out in core.step():
                prompt = out.prompt_logprobs or prompt
        assert prompt is not None
        entries = prompt[1:]
        return torch.tensor([e.logprob for e in entries]), [e.top[0][0] if e.top else -1 for e in entries]

    return engine.run_in_engine_thread(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file; default: the packaged model")
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    reference, best = scored(args.model, "auto", args.tokens)
    eight, best8 = scored(args.model, "int8", args.tokens)
    drift = (eight - reference).abs()
    changed = sum(a != b for a, b in zip(best, best8))
    print(
        f"int8 KV vs bf16 KV over {len(drift)} tokens: mean |Δ logprob| {drift.mean():.4f}, max {drift.max():.3f};"
        f" most likely token changed at {changed} ({changed / len(drift):.1%})"
    )


if __name__ == "__main__":
    main()
