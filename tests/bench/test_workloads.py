"""`tokenmill bench --workload`: its prompts, the agreement of two systems' answers, its page, and a whole run of
tokenmill with speculation and without on the tiny model."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import compile_path

from tests.bench.bench_runs import ZEN4, bench_run
from tokenmill.bench import render, report, workload_run, workloads
from tokenmill.bench.run import results_path
from tokenmill.cli import main


def test_the_edit_workload_asks_to_rewrite_dependencies_functions() -> None:
    edit = workloads.workload("edit")
    assert len(edit.prompts) == len(edit.sources) >= 4
    assert all(not source.startswith("tokenmill") for source in edit.sources)
    prompt = edit.prompts[edit.sources.index("starlette.routing:compile_path")]
    assert inspect.getsource(compile_path).rstrip() in prompt
    assert "`compile_path_v2`" in prompt and prompt.endswith("```python\n")


def test_the_score_workload_asks_to_quote_documentation() -> None:
    score = workloads.workload("score")
    assert len(score.prompts) == len(score.sources) >= 4
    prompt = score.prompts[score.sources.index("prometheus_client.metrics:Counter")]
    assert "A Counter tracks counts of events" in prompt and prompt.endswith('Answer: "')


def test_the_free_workload_is_the_standard_prompts_and_others_are_refused() -> None:
    assert workloads.workload("free").prompts == workloads.PROMPTS
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.workload("chat")


def test_a_source_this_installation_lacks_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workloads, "EDIT_SOURCES", ("starlette.routing:compile_path", "starlette.routing:no_such"))
    assert workloads.workload("edit").sources == ("starlette.routing:compile_path",)
    monkeypatch.setattr(workloads, "EDIT_SOURCES", ("no_such_package:f",))
    with pytest.raises(RuntimeError, match="none of the edit workload's sources"):
        workloads.workload("edit")


def a_pass(single: list[str | None], level: list[str | None]) -> dict[str, Any]:
    return {"single": {"digests": single}, "levels": [{"digests": level}]}


def test_agreement_counts_the_answers_both_gave_in_the_same_place() -> None:
    from tokenmill.bench.workload_run import agreement

    first = [a_pass(["a", "b"], ["c", None, "e"]), a_pass(["a", "b"], ["c"])]
    second = [a_pass(["a", "x"], ["c", "d", "e"]), a_pass(["a", "b"], ["y"])]
    assert agreement(first, second) == {"compared": 7, "identical": 5}


WORKLOAD = {
    "name": "edit",
    "prompts": 8,
    "sources": ["starlette.routing:compile_path"],
    "speculative": "ngram",
    "llama_lookup_args": "--spec-type ngram-simple",
    "agreement": {"compared": 40, "identical": 40},
    "speculation": {"spec_drafts": 10, "spec_draft_tokens": 40, "spec_accepted_tokens": 30, "acceptance": 0.75},
}


def test_a_workload_run_has_its_own_file_heading_and_lines_and_stays_out_of_the_readme(tmp_path: Path) -> None:
    figures = {
        "tokenmill+ngram": {"decode_tok_s": 250.0, "c16_agg_tok_s": 700.0},
        "tokenmill": {"decode_tok_s": 120.0, "c16_agg_tok_s": 500.0},
        "llama-server+lookup": {"decode_tok_s": 70.0, "c16_agg_tok_s": 150.0},
    }
    results = bench_run(ZEN4, figures, "2026-12-06T10:00:00Z", 40.0)
    results["meta"]["workload"] = WORKLOAD
    assert results_path(tmp_path, results["meta"]).name == "amd-epyc-zen4-avx512-2c--gemma-3-270m-q4-k-m--edit.json"
    page = render.render([("edit.json", results)])
    assert "### gemma-3-270m-q4_k_m.gguf, edit workload" in page
    assert "| single-stream decode | tok/s | 250.0 | 120.0 | 70.0 | 2.08× | 3.57× |" in page
    assert "- tokenmill with and without --speculative ngram: 40 of 40 answers identical" in page
    assert "- drafts: 10, draft tokens 40, kept 30 (75%)" in page
    standard = bench_run(ZEN4, {"tokenmill": {"decode_tok_s": 120.0}, "llama-server": {"decode_tok_s": 60.0}}, "d", 1)
    readme = render.summary([("edit.json", results), ("standard.json", standard)])
    assert "tokenmill+ngram" not in readme and "llama-server+lookup" not in readme and "**2.00×**" in readme


def test_workload_lines_leave_out_what_was_not_measured() -> None:
    lines = report.workload_lines({**WORKLOAD, "llama_lookup_args": None, "speculation": {"acceptance": None}})
    assert "drafts" not in lines and "llama-server" not in lines and "40 of 40 answers identical" in lines


def test_a_workload_run_of_tokenmill_with_speculation_and_without_answers_alike(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = ["bench", "--workload", "free", "--model", str(tiny_model_dir), "--rounds", "1", "--single-runs", "2"]
    argv += ["--concurrency", "2", "--requests", "4", "--max-tokens", "12", "--json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert list(results["systems"]) == ["tokenmill+ngram", "tokenmill"]
    agreement = results["meta"]["workload"]["agreement"]
    assert agreement["compared"] == 2 + 4 and agreement["identical"] == agreement["compared"]
    speculation = results["meta"]["workload"]["speculation"]
    assert speculation["spec_drafts"] > 0 and speculation["spec_draft_tokens"] >= speculation["spec_accepted_tokens"]
    assert results["figures"]["tokenmill+ngram"]["c2_agg_tok_s"] > 0
    assert "answers identical" in capsys.readouterr().out


def test_the_drafts_of_every_pass_s_server_are_added_up() -> None:
    """Each pass runs on a server of its own: the speculating server's counts are each pass's, summed."""
    passes = [
        {"spec_drafts": 3, "spec_draft_tokens": 10, "spec_accepted_tokens": 6, "spec_accepted_per_position": [3, 2, 1]},
        {"spec_drafts": 1, "spec_draft_tokens": 2, "spec_accepted_tokens": 2, "spec_accepted_per_position": [1, 1]},
    ]
    summed = workload_run._summed_stats(passes)
    assert (summed["spec_drafts"], summed["spec_draft_tokens"], summed["spec_accepted_tokens"]) == (4, 12, 8)
    assert summed["accepted_per_position"] == [4, 3, 1] and summed["acceptance"] == 8 / 12
    assert workload_run._summed_stats([{"spec_drafts": None}])["acceptance"] is None
