"""What every architecture shares (model/causal_lm.py): here, the bytes of weights one decode step reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.engine.tiny import tiny_config
from tokenmill.model.linear import prepare_linears
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_tied_table_is_read_once_as_the_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32)
    model = build_model(weights.config, weights.state_dict)
    assert model.lm_head is None
    assert model.weight_bytes_per_token() == nbytes(list(model.parameters())) > 0  # the table among them, once


def test_a_quantised_head_is_counted_in_its_own_bytes_and_the_table_is_gone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.bfloat16)
    model = build_model(weights.config, weights.state_dict)
    full = model.weight_bytes_per_token()
    prepare_linears(model, "int8")
    state = model.state_dict()
    assert not any(k.startswith("model.embed_tokens.") for k in state)  # lookups read the int8 head's rows
    assert model.weight_bytes_per_token() == nbytes(list(state.values())) < full


def test_a_separate_heads_embedding_table_is_only_looked_up() -> None:
    cfg = dataclasses.replace(tiny_config(), architecture="llama", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    table = model.model.embed_tokens.weight
    assert model.lm_head is not None
    assert model.weight_bytes_per_token() == nbytes(list(model.parameters())) - nbytes([table])
