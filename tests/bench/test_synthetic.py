"""Random-weight GGUF files of a published shape: the file's shape and metadata, and that tokenmill serves it."""

from __future__ import annotations

import stat
from pathlib import Path

import gguf
import pytest
import torch

from tests.model.families import BY_NAME, write_gguf, write_hf_model
from tests.tiny_model import write_tiny_gguf
from tokenmill.bench import synthetic
from tokenmill.model.loading.gguf_file import read_gguf_file
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model

SMALL = synthetic.Shape("gemma3", hidden=48, layers=3, ffn=96, heads=2, kv_heads=1, head_dim=16, context=256,
                        sliding_window=8)  # fmt: skip
ROPE = synthetic.Llama3Rope(theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
SMALL_LLAMA = synthetic.Shape("llama", hidden=64, layers=2, ffn=160, heads=4, kv_heads=2, head_dim=32, context=512,
                              sliding_window=None, llama3_rope=ROPE)  # fmt: skip


def test_the_file_has_the_shape_and_the_sources_tokenizer(tmp_path: Path) -> None:
    source = write_tiny_gguf(tmp_path / "source.gguf")
    target = tmp_path / "synthetic.gguf"
    synthetic.write_f16(SMALL, source, target)
    meta, tensors = read_gguf_file(str(target))
    source_meta, source_tensors = read_gguf_file(str(source))
    assert meta["gemma3.embedding_length"] == 48 and meta["gemma3.block_count"] == 3
    assert meta["gemma3.feed_forward_length"] == 96 and meta["gemma3.attention.sliding_window"] == 8
    tokenizer_keys = [k for k in source_meta if k.startswith("tokenizer.")]
    assert tokenizer_keys and all(meta[k] == source_meta[k] for k in tokenizer_keys)
    vocab = next(t.shape[-1] for t in source_tensors if t.name == "token_embd.weight")
    shapes = {t.name: t.shape for t in tensors}
    assert shapes["token_embd.weight"] == (48, vocab) and shapes["blk.2.ffn_down.weight"] == (96, 48)
    assert len(tensors) == 2 + 3 * 13


def test_tokenmill_loads_it_as_a_model_of_that_shape(tmp_path: Path) -> None:
    source = write_tiny_gguf(tmp_path / "source.gguf")
    target = tmp_path / "synthetic.gguf"
    synthetic.write_f16(SMALL, source, target, seed=1)
    weights = load_model_files(str(target), str(tmp_path / "cache"), torch.float32)
    cfg = weights.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.sliding_window) == (48, 3, 96, 8)
    model = build_model(cfg, weights.state_dict)  # strict: every tensor present, none left over
    logits = model.forward_dense(torch.tensor([2, 5, 7, 11]))
    assert logits.shape == (4, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_a_missing_file_is_written_then_quantised_and_the_f16_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(synthetic.SHAPES, "small", SMALL)
    quantize = tmp_path / "llama-quantize"  # a stand-in that records its arguments and copies the file
    quantize.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncp "$1" "$2"\n')
    quantize.chmod(quantize.stat().st_mode | stat.S_IXUSR)
    source = write_tiny_gguf(tmp_path / "source.gguf")
    out = synthetic.ensure_synthetic("small", tmp_path / "synthetic", quantize, source)
    assert out == synthetic.synthetic_path(tmp_path / "synthetic", "small") and out.is_file()
    args = (tmp_path / "args").read_text().split()
    assert args[0].endswith("small-random-F16.gguf") and args[2] == "Q4_K_M"
    assert not Path(args[0]).exists()
    quantize.unlink()  # a second call finds the file and runs nothing
    assert synthetic.ensure_synthetic("small", tmp_path / "synthetic", quantize, source) == out


def _llama_source(tmp_path: Path) -> Path:
    """A real-shaped Llama 3 GGUF (as llama.cpp's converter writes one) whose rotary width says 16, not the 32 the
    synthetic shape has: as llama.cpp's Llama 3 vocabulary file says 128, not Llama 3.2 1B's 64."""
    family = BY_NAME["llama3"]
    written = write_gguf(tmp_path / "llama3.gguf", family, write_hf_model(tmp_path / "hf", family))
    reader = gguf.GGUFReader(written)
    source = tmp_path / "source.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_rope_dimension_count(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()  # a vocabulary file: metadata, no tensors
    writer.close()
    return source


def test_a_llama_shape_loads_with_its_shape_and_llama3_rope(tmp_path: Path) -> None:
    source = _llama_source(tmp_path)
    target = tmp_path / "synthetic.gguf"
    synthetic.write_f16(SMALL_LLAMA, source, target)
    meta, tensors = read_gguf_file(str(target))
    assert meta["llama.rope.dimension_count"] == 32 and meta["llama.attention.key_length"] == 32
    names = {t.name for t in tensors}
    assert "output.weight" not in names and "blk.1.post_ffw_norm.weight" not in names and "rope_freqs.weight" in names
    assert len(tensors) == 2 + 2 * 9 + 1
    weights = load_model_files(str(target), str(tmp_path / "cache"), torch.float32)
    cfg = weights.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == ("llama", 64, 2, 160)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (4, 2, 32, True)
    model = build_model(cfg, weights.state_dict)
    logits = model.forward_dense(torch.tensor([2, 5, 7, 11]))
    assert logits.shape == (4, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_llama3_rope_divisors_are_what_transformers_scales_by() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": ROPE.theta, "factor": ROPE.factor}
    rope |= {"low_freq_factor": ROPE.low_freq_factor, "high_freq_factor": ROPE.high_freq_factor}
    rope |= {"original_max_position_embeddings": ROPE.original_context}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (ROPE.theta ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    divisors = torch.from_numpy(synthetic.llama3_rope_divisors(ROPE, 32))
    assert {1.0, ROPE.factor} < set(divisors.tolist())  # kept, divided, and blended frequencies all occur
    torch.testing.assert_close(plain / divisors, scaled, rtol=1e-5, atol=0)
