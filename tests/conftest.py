"""Shared fixtures: the tiny random-weight model directory (fast tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer files) of a tiny random Gemma 3."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"))
