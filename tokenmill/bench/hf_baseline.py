"""Plain Hugging Face `transformers` generation on the same weights, as a baseline: single-stream greedy decode and one
batched generate. Run as a subprocess (`python -m tokenmill.bench.hf_baseline`) so its memory stays out of the servers'
figures; it prints one JSON line.

The weights come from tokenmill's loader (the GGUF dequantised to float32 with Hugging Face names, cached), which is
much faster than `from_pretrained(gguf_file=...)`; only Gemma 3 is mapped.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from tokenmill.bench.load import PROMPTS


def build_hf_gemma3(cfg: Any, state_dict: dict[str, Any], dtype: Any) -> Any:
    from tokenmill.bench.hf_reference import transformers_gemma3

    if cfg.architecture != "gemma3":
        raise SystemExit(f"the transformers baseline maps Gemma 3 only, not {cfg.architecture}")
    return transformers_gemma3(cfg, state_dict, attn_implementation="sdpa").to(dtype)


class _TokenClock:
    """A generate() streamer that notes when each step's tokens arrive (the prompt's echo first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model: Any, ids: Any, mask: Any, new_tokens: int, eos_ids: list[int]) -> tuple[float, float]:
    """(seconds to the first new token, seconds from it to the last): apart, so that a decode rate never divides by
    a difference of two separately timed runs, which a busy machine can make negative."""
    import torch

    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            suppress_tokens=eos_ids,
            eos_token_id=eos_ids,
            pad_token_id=0,
            streamer=clock,
        )
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise SystemExit(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt, put before any step
    return first - start, last - first


def left_padded(prompts: list[list[int]]) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, T), pad id 0
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, T)
    return ids, mask


def measure(
    dtype_name: str, model_path: str | None, cache_dir: str | None, max_tokens: int, batch: int, runs: int
) -> dict[str, Any]:
    import torch

    from tokenmill.model.loading.loader import load_model_files

    dtype = getattr(torch, dtype_name)
    start = time.perf_counter()
    weights = load_model_files(model_path, cache_dir, torch.float32)
    model = build_hf_gemma3(weights.config, weights.state_dict, dtype)
    load_s = time.perf_counter() - start
    tok, eos_ids = weights.tokenizer, list(weights.tokenizer.eos_ids)
    one = left_padded([tok.encode(PROMPTS[0])])
    timed_generate(model, *one, 8, eos_ids)  # warm-up
    rates, ttfts = [], []
    for _ in range(runs):
        first, decode = timed_generate(model, *one, max_tokens, eos_ids)
        ttfts.append(first)
        rates.append((max_tokens - 1) / decode if max_tokens > 1 else float("nan"))  # one token: no decode
    many = left_padded([tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)])
    batch_s = sum(timed_generate(model, *many, max_tokens, eos_ids))
    return {
        "dtype": dtype_name,
        "load_s": load_s,
        "decode_tok_s": statistics.median(rates),
        "ttft_s": statistics.median(ttfts),
        f"batch{batch}_agg_tok_s": batch * max_tokens / batch_s,
        "batch": batch,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


def run_in_subprocess(
    dtype: str, model_path: str | None, cache_dir: str | None, max_tokens: int, batch: int, runs: int, timeout_s: float
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "tokenmill.bench.hf_baseline",
        "--dtype",
        dtype,
        "--max-tokens",
        str(max_tokens),
        "--batch",
        str(batch),
        "--runs",
        str(runs),
    ]
    argv += ["--model", model_path] if model_path else []
    argv += ["--cache-dir", cache_dir] if cache_dir else []
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"transformers baseline ({dtype}) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.dtype, args.model, args.cache_dir, args.max_tokens, args.batch, args.runs)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
