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
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.kernels import ops
from tokenmill.server.load import load_engine_core

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
    # plain steps: a drafted step would give a lone row several rows, off the lone greedy row's path
    config = Config(model=str(path), cache_dir=str(tmp_path / "cache"), max_num_seqs=16, speculative="off")
    return load_engine_core(config).core


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

    def watched(hidden: torch.Tensor, keep: list[int] | None = None):  # type: ignore[no-untyped-def]
        logits, summary = summarised(hidden, keep)
        found.append(summary)
        return logits, summary

    monkeypatch.setattr(core.runner.model, "compute_logits_summarised", watched)
    with_head = outputs(core)
    assert found and all(s is not None for s in found)  # the head's pass did answer
    monkeypatch.setattr(
        core.runner.model, "compute_logits_summarised", lambda h, keep=None: (core.runner.model.compute_logits(h), None)
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


LONE = {  # a request alone in its steps: a lone greedy row reads the head's 6-bit copy where its sampling allows
    "plain": SamplingParams(max_tokens=12, temperature=0.0),
    "biased": SamplingParams(max_tokens=12, temperature=0.0, logit_bias={1: -100.0, 7: 3.0}),
    "forced": SamplingParams(max_tokens=12, temperature=0.0, logit_bias={7: 100.0}),
    "banned": SamplingParams(max_tokens=12, temperature=0.0, min_tokens=12, bad_words_ids=[[9], [14]]),
    "penalised": SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5),
    "with logprobs": SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
    "sampled": SamplingParams(max_tokens=12, temperature=0.8, seed=5),
}


def test_a_lone_greedy_row_decodes_the_same_from_the_heads_6_bit_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's pass answers only where the row's sampling reads nothing but its argmax and the ids it changes; its
    tokens are those of the full pass, each request alone, with and without the copy."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", quantize=True)  # a Q8_0 head
    answered: list[str] = []  # a prompt's first token: the head's own call
    in_call: list[str] = []  # a decode row's: in the same C call as the layers
    greedy_row, answer = ops.gguf_greedy_row, ops.greedy_answer

    def watched(*args):  # type: ignore[no-untyped-def]
        found = greedy_row(*args)
        answered.append(name if found is not None else "")
        return found

    def watched_answer(*args):  # type: ignore[no-untyped-def]
        found = answer(*args)
        in_call.append(name if found is not None else "")
        return found

    monkeypatch.setattr(ops, "gguf_greedy_row", watched)
    monkeypatch.setattr(ops, "greedy_answer", watched_answer)
    tokens: dict[bool, dict[str, list[int]]] = {}
    for copy in (True, False):
        config = Config(model=str(path), cache_dir=str(tmp_path / "cache"), greedy_head=copy, speculative="off")
        core = load_engine_core(config).core
        assert (core.runner.model.lm_head.high6 is not None) == copy
        tokens[copy] = {}
        for i, (name, params) in enumerate(LONE.items()):
            core.add_request(name, [2, 5 + i, 9, 14, 3], params)
            tokens[copy][name] = [t for o in run_all(core)[name] for d in o.deltas for t in d.token_ids]
    assert tokens[True] == tokens[False]
    assert {"plain", "biased", "forced", "banned", "penalised"} <= {*answered, *in_call}
    assert {"plain", "biased"} <= set(answered) & set(in_call)  # the first token in the head's call, the rest in one
    assert not {"with logprobs", "sampled"} & {*answered, *in_call}


def test_a_decode_row_whose_copy_cannot_answer_takes_the_full_pass_and_rests_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the copy's pass in the layers' call cannot answer, the row's head is the full pass, the same tokens, and
    the next rows go straight to the full pass for a while (as when the head's own call misses)."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", quantize=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={1: -100.0})

    def tokens(core: EngineCore) -> list[int]:
        core.add_request("r", [2, 5, 9, 14, 3], params)
        return [t for o in run_all(core)["r"] for d in o.deltas for t in d.token_ids]

    config = Config(model=str(path), cache_dir=str(tmp_path / "cache"), speculative="off")
    expected = tokens(load_engine_core(config).core)
    asked: list[bool] = []
    step = ops.decoder_forward

    def watched(*args):  # type: ignore[no-untyped-def]
        asked.append(len(args) > 10 and args[10] is not None)
        return step(*args)

    monkeypatch.setattr(ops, "decoder_forward", watched)
    monkeypatch.setattr(ops, "greedy_answer", lambda *args: None)  # as gguf_greedy_row's status 1
    assert tokens(load_engine_core(config).core) == expected
    assert asked[:2] == [False, True] and not any(asked[2:]), "".join(str(int(a)) for a in asked)
