"""Speculative decoding on the default model, as a user runs it (bfloat16, the GGUF file's own blocks, the LM head's
quick pass for a lone greedy row): the same tokens, logprobs, text and finish with drafts as without, alone and with
other streams beside it, and drafts that do pay on text that repeats."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

from tests.engine.tiny import FixedCost
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.speculation import MAX_FIXED_ROWS
from tokenmill.server.load import load_engine_core

CODE = inspect.getsource(json.dumps)[:1200]
EDIT = f"Here is a function:\n\n```python\n{CODE}\n```\n\nThe same function with its docstring removed:\n\n```python\n"
PROMPTS = {
    "edit": EDIT,
    "story": "Once upon a time, in a village by the sea,",
    "recipe": "Here is a short recipe for tomato soup:",
    "code": "import numpy as np\n\ndef normalize(x):",
}


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EngineCore]:
    cache = str(tmp_path_factory.mktemp("cache"))
    cores = {method: load_engine_core(Config(cache_dir=cache, speculative=method)).core for method in ("off", "ngram")}
    cores["ngram"].step_cost = FixedCost(MAX_FIXED_ROWS)  # drafts as if rows were free: not hanging on the timing
    return cores


def outputs(core: EngineCore, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, Any]:
    tok = core.tokenizer
    for name, (prompt, params) in requests.items():
        core.add_request(name, tok.encode(prompt), params)
    found: dict[str, Any] = {}
    for _ in range(5000):
        for out in core.step():
            assert out.error is None, out.error
            for d in out.deltas:
                c = found.setdefault(f"{out.request_id}/{d.index}", {"ids": [], "text": "", "logprobs": []})
                c["ids"] += d.token_ids
                c["text"] += d.text
                c["logprobs"] += [(e.token_id, e.logprob, e.top) for e in d.logprobs or []]
                if d.finish_reason is not None:
                    c["finish"] = (d.finish_reason, d.stop_reason)
        if not core.has_work:
            return found
    raise AssertionError("the engine did not finish")


def greedy(core: EngineCore, max_tokens: int = 96, **extra: Any) -> SamplingParams:
    ban = {i: -100.0 for i in core.tokenizer.eos_ids}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=ban, **extra)


def test_each_prompt_alone_gives_the_same_output(cores: dict[str, EngineCore]) -> None:
    for name, prompt in PROMPTS.items():
        requests = {name: (prompt, greedy(cores["off"]))}
        assert outputs(cores["ngram"], requests) == outputs(cores["off"], requests), name
    st = cores["ngram"].snapshot_stats()
    # the edit prompt repeats its code: most drafts keep their first token, whatever their length
    assert st.spec_accepted_per_position[0] > 0.5 * st.spec_drafts > 0


def test_streams_side_by_side_with_logprobs_and_stops_give_the_same_output(cores: dict[str, EngineCore]) -> None:
    off = cores["off"]
    requests = {
        "edit": (EDIT, greedy(off, logprobs=2)),
        "story": (PROMPTS["story"], greedy(off, stop=["."])),
        "sampled": (PROMPTS["recipe"], SamplingParams(max_tokens=40, temperature=0.8, seed=7)),
        "copied": (EDIT, SamplingParams(max_tokens=60, temperature=0.7, top_p=0.9, seed=3, logprobs=1)),
        "code": (PROMPTS["code"], greedy(off, max_tokens=40, frequency_penalty=0.3)),
    }
    assert outputs(cores["ngram"], requests) == outputs(off, requests)


def test_a_seeded_sampled_stream_alone_keeps_its_text(cores: dict[str, EngineCore]) -> None:
    before = cores["ngram"].snapshot_stats().spec_accepted_tokens
    requests = {"copied": (EDIT, SamplingParams(max_tokens=80, temperature=0.7, top_p=0.9, seed=5, logprobs=1))}
    assert outputs(cores["ngram"], requests) == outputs(cores["off"], requests)
    assert cores["ngram"].snapshot_stats().spec_accepted_tokens > before  # its drafts were checked and kept
