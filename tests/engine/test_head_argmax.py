"""The LM head's own pass (a GGUF head): its argmax and finiteness stand in for the sampler's passes over the logits,
and the engine's outputs are the ones those passes give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.tiny import poison_hidden, run_all
from tests.model.gguf_blocks import MIXED
from tests.tiny_model import write_tiny_gguf
from tokenmill.config import Config
from tokenmill.engine.build import load_engine_core
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.kernels import ops

pytestmark = pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")

REQUESTS = {
    "plain": SamplingParams(max_tokens=10, temperature=0.0),
    "biased": SamplingParams(max_tokens=10, temperature=0.0, logit_bias={1: -100.0, 7: 3.0}),
    "forced": SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 100.0}),  # the raw argmax never wins
    "penalised": SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5),
    "forked": SamplingParams(max_tokens=10, temperature=0.0, n=2, logprobs=2),
    "sampled": SamplingParams(max_tokens=10, temperature=0.8, seed=5),
}


def gguf_core(tmp_path: Path) -> EngineCore:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    return load_engine_core(Config(model=str(path), cache_dir=str(tmp_path / "cache"), max_num_seqs=16)).core


def outputs(core: EngineCore) -> dict[str, list[tuple[int, list[int]]]]:
    for i, (name, params) in enumerate(REQUESTS.items()):
        core.add_request(name, [2, 5 + i, 9, 14, 3], params)
    return {name: [(d.index, d.token_ids) for o in outs for d in o.deltas] for name, outs in run_all(core).items()}


def test_the_outputs_are_the_ones_the_passes_over_the_logits_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = gguf_core(tmp_path)
    found = []
    summarised = core.runner.model.compute_logits_summarised

    def watched(hidden: torch.Tensor):  # type: ignore[no-untyped-def]
        logits, summary = summarised(hidden)
        found.append(summary)
        return logits, summary

    monkeypatch.setattr(core.runner.model, "compute_logits_summarised", watched)
    with_head = outputs(core)
    assert found and all(s is not None for s in found)  # the head's pass did answer
    monkeypatch.setattr(
        core.runner.model, "compute_logits_summarised", lambda h: (core.runner.model.compute_logits(h), None)
    )
    assert outputs(core) == with_head


def test_a_row_the_head_finds_not_finite_fails_only_its_request(tmp_path: Path) -> None:
    core = gguf_core(tmp_path)
    poison_hidden(core, lambda seq: seq.request_id == "biased")
    for i, (name, params) in enumerate(REQUESTS.items()):
        core.add_request(name, [2, 5 + i, 9, 14, 3], params)
    outs = run_all(core)
    assert outs["biased"][-1].error is not None and "non-finite" in outs["biased"][-1].error
    assert all(o.error is None for name, got in outs.items() if name != "biased" for o in got)
