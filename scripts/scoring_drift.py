"""How far each compute mode's echo-scored logprobs drift from the float32 reference on the same weights.

python scripts/scoring_drift.py            # 600 tokens of README.md, modes bf16, bf16+gguf (the default), +int8, +int4
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.model.linear import prepare_linears
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model

TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()[:3000]
MODES = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "gguf"), ("bfloat16", "int8"), ("bfloat16", "int4")]


def token_logprobs(dtype: str, quantization: str) -> torch.Tensor:
    loaded = load_model_files(None, None, getattr(torch, dtype), quantization)
    model = build_model(loaded.config, loaded.state_dict, prepared=loaded.prepared, quantized=loaded.quantized)
    prepare_linears(model, quantization)
    ids = torch.tensor(loaded.tokenizer.encode(TEXT)[:600])
    logprobs = torch.log_softmax(model.forward_dense(ids), dim=-1)  # (T, V)
    return logprobs[:-1].gather(1, ids[1:, None])[:, 0]  # each token's logprob given the ones before it


def main() -> None:
    reference = token_logprobs(*MODES[0])
    for dtype, quantization in MODES[1:]:
        drift = (token_logprobs(dtype, quantization) - reference).abs()
        print(
            f"{dtype} {quantization}: mean |Δ logprob| {drift.mean():.4f}, max {drift.max():.3f} "
            f"over {len(drift)} tokens"
        )


if __name__ == "__main__":
    main()
