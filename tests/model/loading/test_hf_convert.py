"""A Hugging Face directory converted one linear at a time from its mapped files gives exactly the model the plain way
gives (every tensor read, the model built, prepare_linears): the same modules, the same tensors bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.families import BY_NAME, FAMILIES, write_hf_model
from tokenmill.model.linear import prepare_linears
from tokenmill.model.loading.hf_convert import prepared_state_dict
from tokenmill.model.loading.hf_dir import Checkpoint, read_hf_config, read_hf_state_dict
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for family in FAMILIES:
        write_hf_model(root / family.name, family)
    return {family.name: root / family.name for family in FAMILIES}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_layer_by_layer_equals_the_whole_model_prepared(
    directories: dict[str, Path], family: str, quantization: str
) -> None:
    path = directories[family]
    config = read_hf_config(path)
    plain = build_model(config, read_hf_state_dict(path, config, torch.bfloat16))
    prepare_linears(plain, quantization)
    streamed = build_model(
        config, prepared_state_dict(Checkpoint(path, config), config, torch.bfloat16, quantization), prepared=True
    )
    prepare_linears(streamed, quantization)  # idempotent: the engine calls it on every model
    assert [(k, type(m)) for k, m in streamed.named_modules()] == [(k, type(m)) for k, m in plain.named_modules()]
    want, got = plain.state_dict(), streamed.state_dict()
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    ids = torch.arange(3, 19)
    assert torch.equal(streamed.forward_dense(ids), plain.forward_dense(ids))


def test_the_loader_takes_this_path_for_a_quantised_start(directories: dict[str, Path], tmp_path: Path) -> None:
    loaded = load_model_files(str(directories["qwen2"]), str(tmp_path), torch.bfloat16, "int8")
    assert loaded.prepared and any(key.endswith(("qkv_proj.tiles", "qkv_proj.qweight")) for key in loaded.state_dict)
    unquantised = load_model_files(str(directories["qwen2"]), str(tmp_path), torch.bfloat16, "none")
    assert not unquantised.prepared and "model.layers.0.self_attn.q_proj.weight" in unquantised.state_dict


def test_a_released_tensor_reads_back_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "llama"
    write_hf_model(path, BY_NAME["llama"])
    checkpoint = Checkpoint(path, read_hf_config(path))
    name = "model.layers.0.mlp.down_proj.weight"
    before = checkpoint.view(name).clone()
    checkpoint.release(name)
    assert torch.equal(checkpoint.view(name), before)
    assert torch.equal(checkpoint.take(name, torch.float32), before)
