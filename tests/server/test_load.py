"""Loading the model a config names (server/load.py): a model this server cannot take fails as one ModelLoadError."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tiny_model
from tokenmill.config import Config
from tokenmill.server.load import ModelLoadError, load_engine_core


def test_a_gguf_vocabulary_no_builder_takes_fails_the_load_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is built on a thread while the weights are regrouped; its error still fails the load as one."""
    meta = tiny_model.tiny_gguf_metadata()
    monkeypatch.setattr(tiny_model, "tiny_gguf_metadata", lambda: {**meta, "tokenizer.ggml.model": "bert"})
    path = tiny_model.write_tiny_gguf(tmp_path / "bert.gguf", quantize=True)
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        load_engine_core(Config(model=str(path), cache_dir=str(tmp_path / "cache")))
