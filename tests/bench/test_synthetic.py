"""Random-weight GGUF files of a published shape: the file's shape and metadata, and that tokenmill serves it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from tests.tiny_model import write_tiny_gguf
from tokenmill.bench import synthetic
from tokenmill.model.loading.gguf_file import read_gguf_file
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model

SMALL = synthetic.Shape("gemma3", hidden=48, layers=3, ffn=96, heads=2, kv_heads=1, head_dim=16, context=256,
                        sliding_window=8)  # fmt: skip


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
