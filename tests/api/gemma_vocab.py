"""The real engine on a tiny random model over tests/tiny_model.py's Gemma-shaped vocabulary: a few whole words, and
byte-fallback pieces for everything else (tests/engine/tiny.py's engine has one token a byte instead)."""

from __future__ import annotations

import pytest
import torch

from tests.api.api_helpers import TINY_MODEL
from tests.engine.tiny import tiny_config
from tests.tiny_model import VOCAB_PAD, tiny_tokenizer
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.guided import GuidedState
from tokenmill.engine.outputs import RequestOutput
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.server.engine_core import build_engine_core


def gemma_vocab_core(**overrides: object) -> EngineCore:
    """The tiny random model over the Gemma-shaped vocabulary (which llguidance can read), as an engine core;
    `overrides`: Config fields (speculation's, say)."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_config(VOCAB_PAD))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    settings: dict[str, object] = {
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
        **overrides,
    }
    config = Config(**settings)  # type: ignore[arg-type]
    return build_engine_core(model.eval(), tiny_tokenizer(), config)


def gemma_vocab_engine() -> AsyncEngine:
    """Served as TINY_MODEL, not yet started."""
    return AsyncEngine(gemma_vocab_core(), TINY_MODEL, "fp_tiny")


def masks_per_step(monkeypatch: pytest.MonkeyPatch, core: EngineCore) -> list[int]:
    """The grammar masks (GuidedState.allowed) `core` computes in each of its steps from now on: one count a step,
    appended as the steps run."""
    counts: list[int] = []
    allowed, step = GuidedState.allowed, core.step

    def counted(self: GuidedState) -> torch.Tensor:
        counts[-1] += 1
        return allowed(self)

    def counting_step() -> list[RequestOutput]:
        counts.append(0)
        return step()

    monkeypatch.setattr(GuidedState, "allowed", counted)
    monkeypatch.setattr(core, "step", counting_step)
    return counts
