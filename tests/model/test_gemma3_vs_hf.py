"""Our Gemma 3 gives the logits of `transformers`' Gemma3ForCausalLM on the same weights (fp32, eager attention)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill.bench.hf_reference import transformers_gemma3
from tokenmill.model.loading.loader import LoadedWeights, load_model_files
from tokenmill.model.model_config import ModelConfig
from tokenmill.model.registry import build_model

# Float32 reduction order: our attention sums keys in fixed 64-key chunks (for batch invariance), transformers' eager
# attention over whole rows. On the 640-token prompt below, logits reach |41| and the two differ by up to 1.2e-3;
# transformers' own eager and sdpa attentions differ by 4.4e-4 there. Anything structurally wrong is far larger.
TOLERANCE = 2.5e-3


def hf_gemma3(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    return transformers_gemma3(cfg, state_dict).float()


def _layer_outputs(model: nn.Module, run: object) -> list[torch.Tensor]:
    """Each decoder layer's output hidden states during `run()`."""
    outputs: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, out: object) -> None:
        outputs.append((out[0] if isinstance(out, tuple) else out).reshape(-1, out_dim(out)).detach().clone())

    def out_dim(out: object) -> int:
        return (out[0] if isinstance(out, tuple) else out).shape[-1]  # type: ignore[index, union-attr]

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]  # type: ignore[union-attr]
    try:
        run()  # type: ignore[operator]
    finally:
        for h in handles:
            h.remove()
    return outputs


def compare(weights: LoadedWeights, prompts: list[list[int]]) -> None:
    ours = build_model(weights.config, {k: v.clone() for k, v in weights.state_dict.items()})
    theirs = hf_gemma3(weights.config, weights.state_dict)
    for ids in prompts:
        input_ids = torch.tensor(ids)
        ours_logits = ours.forward_dense(input_ids)  # (T, V)
        with torch.no_grad():
            hf_logits = theirs(input_ids[None]).logits[0].float()  # (T, V)
        diff = (ours_logits - hf_logits).abs().max().item()
        if diff > TOLERANCE:
            pytest.fail(
                f"prompt of {len(ids)} tokens: max |Δlogit| = {diff:.3g}; {_divergence(ours, theirs, input_ids)}"
            )


def _divergence(ours: nn.Module, theirs: nn.Module, input_ids: torch.Tensor) -> str:
    a = _layer_outputs(ours, lambda: ours.forward_dense(input_ids))
    with torch.no_grad():
        b = _layer_outputs(theirs, lambda: theirs(input_ids[None]))
    diffs = [f"layer {i}: {(x - y).abs().max().item():.3g}" for i, (x, y) in enumerate(zip(a, b))]
    return "per-layer max |Δhidden|: " + ", ".join(diffs)


def test_tiny_gemma3_logits_equal_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32)
    gen = torch.Generator().manual_seed(0)
    text = weights.tokenizer.encode("The capital of France is Paris. def hello(world): return the world\n\n" * 3)
    prompts = [text, [2], torch.randint(0, weights.config.vocab_size, (40,), generator=gen).tolist()]
    compare(weights, prompts)  # 40 tokens > the sliding window of 8


@pytest.mark.e2e
def test_gemma3_270m_logits_equal_transformers() -> None:
    weights = load_model_files(None, None, torch.float32)
    tok = weights.tokenizer
    long_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
        tok.encode("日本語とemoji 🎉 mixed with café"),
        tok.encode(long_text)[:640],  # past the 512-token sliding window
    ]
    assert len(prompts[-1]) == 640
    compare(weights, prompts)
