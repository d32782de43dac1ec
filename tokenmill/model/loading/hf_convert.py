"""A Hugging Face checkpoint → the engine's prepared (stacked, quantised) weights, one linear layer at a time.

The plain way — every tensor read into memory, the model built, then each linear quantised (prepare_linears) —
holds the whole checkpoint in its dtype next to the quantised copy: ~2.5× an int8 model's bytes at the peak, more
than a 24 GB machine has for an 8B model. Here each linear's parts (q/k/v, or gate/up) are read from the mapped file,
stacked, quantised by the same `make_linear` prepare_linears uses, and their file pages handed back before the next
one, so the peak is the quantised model plus one stacked layer. The result is the state dict of a prepared model,
key for key and bit for bit (tests/model/loading/test_hf_convert.py), which build_model adopts as it adopts a cached
prepared GGUF.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.linear import Int8Linear, TiledInt8Linear, make_linear
from tokenmill.model.loading.hf_dir import Checkpoint
from tokenmill.model.model_config import ModelConfig
from tokenmill.model.registry import model_skeleton

HEAD, EMBEDDING = "lm_head", "model.embed_tokens.weight"


def prepared_state_dict(
    checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype, quantization: str
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a prepared model of `config` holds them: every bias-free linear quantised (stacked
    where the model stacks projections), everything else (norms, biases, an untied embedding) copied in `dtype`."""
    skeleton = model_skeleton(config)  # on the meta device: which linears there are, and under which names
    stacked = type(skeleton).STACKED_PROJECTIONS
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    tied = getattr(skeleton, HEAD, None) is None  # the head is made from the embedding table, as prepare_linears does
    if tied:  # first, while nothing else is held: the largest matrix, its file pages in memory while it is quantised
        head = _quantise_into(out, HEAD, [EMBEDDING], checkpoint, dtype, quantization)
        if isinstance(head, Int8Linear | TiledInt8Linear):  # an int8 head serves the lookups: the table goes
            consumed.add(EMBEDDING)
        checkpoint.release(EMBEDDING)
    for key, module in skeleton.named_modules():
        if isinstance(module, nn.Linear) and module.bias is None:
            parts = _linear_parts(checkpoint, key, stacked)
            _quantise_into(out, key, parts, checkpoint, dtype, quantization)
            consumed.update(parts)
            for part in parts:
                checkpoint.release(part)
    for name in checkpoint.names():
        if name not in consumed:
            out[name] = checkpoint.take(name, dtype)
    return out


def _linear_parts(checkpoint: Checkpoint, key: str, stacked: dict[str, tuple[str, ...]]) -> list[str]:
    """The checkpoint tensors a model linear is made of: its own weight, or the projections the model stacks into it
    (a checkpoint that already fuses them, as Phi-3's does, has the stacked name itself)."""
    if f"{key}.weight" in checkpoint:
        return [f"{key}.weight"]
    prefix, _, name = key.rpartition(".")
    if name in stacked:
        return [f"{prefix}.{part}.weight" for part in stacked[name]]
    raise KeyError(f"the checkpoint has no weight for {key}")


def _quantise_into(
    out: dict[str, torch.Tensor],
    key: str,
    parts: list[str],
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    quantization: str,
) -> nn.Module:
    """The linear made of `parts` (stacked, cast to `dtype`), quantised; its tensors into `out` under `key`."""
    views = [checkpoint.view(part) for part in parts]
    # one part already in `dtype` is quantised from the file's pages as they are (make_linear reads it in slices)
    weight = views[0] if len(views) == 1 and views[0].dtype == dtype else torch.cat(views).to(dtype)
    linear = make_linear(weight, quantization)
    out.update({f"{key}.{name}": tensor for name, tensor in linear.state_dict().items()})
    return linear
