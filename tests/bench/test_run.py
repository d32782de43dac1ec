"""The `tokenmill bench` flow, against the fake OpenAI server on loopback."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.fake_openai import EOS_ID, FakeOpenAI
from tokenmill.bench import run
from tokenmill.cli import main


def test_bench_on_a_url_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeOpenAI()
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--url",
        "(the fake's)",
        "--requests",
        "4",
        "--max-tokens",
        "8",
        "--concurrency",
        "1",
        "2",
        "--rounds",
        "2",
        "--api-key",
        "secret",
        "--json",
        str(out),
    ]
    with fake.running() as url:
        assert main([url if a == "(the fake's)" else a for a in argv]) == 0
    printed = capsys.readouterr().out
    assert "single-stream decode" in printed and "2 clients: aggregate" in printed
    assert "prefill, 8,000-token prompt" in printed
    results = json.loads(out.read_text())
    assert len(results["systems"]["server"]["passes"]) == 2
    assert results["systems"]["server"]["passes"][0]["eos_ids"] == [EOS_ID]
    assert results["figures"]["server"]["c2_agg_tok_s"] > 0
    assert (
        results["figures"]["server"]["prefill512_tok_s"] > 0 and results["figures"]["server"]["prefill8000_tok_s"] > 0
    )
    assert "secret" not in out.read_text()
    assert len(fake.bodies) == 2 * (1 + 2 + 1 + 2 + 4 + 4)  # one probe of the passage, then each prefill's prompt


def test_the_json_says_what_ran_where_and_a_folder_gets_a_file_per_machine_and_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpenAI()
    with fake.running() as url:
        argv = ["bench", "--url", url, "--model", "/models/gemma-3-270m-q4_k_m.gguf", "--no-bandwidth"]
        argv += ["--requests", "2", "--max-tokens", "4", "--concurrency", "1", "--single-runs", "1"]
        argv += ["--api-key", "secret", "--json", str(tmp_path)]
        monkeypatch.setattr(sys, "argv", ["tokenmill", *argv])
        assert main(argv) == 0
    [written] = tmp_path.glob("*.json")
    meta = json.loads(written.read_text())["meta"]
    assert written.name == f"{meta['machine']['kind']}--gemma-3-270m-q4-k-m.json"
    assert meta["argv"] == ["tokenmill", *argv[:-3], "***", *argv[-2:]]  # the key masked
    assert meta["command"] == shlex.join(meta["argv"]) and "secret" not in written.read_text()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    assert meta["tokenmill"]["version"] and meta["model"] == "gemma-3-270m-q4_k_m.gguf" and meta["peers"] == {}
    assert {"cpu", "vendor", "cores", "isa", "kind"} <= set(meta["machine"])


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--url", "http://10.1.2.3:8000"],
        ["bench", "--url", "http://example.com:8000"],
        ["bench", "--url", "http://127.0.0.1:8000", "--compare"],
    ],
)
def test_refused_runs_exit_2_without_sending_anything(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "tokenmill bench:" in capsys.readouterr().err


def server_pass(decode: float, agg16: float, early: int = 0, failed: int = 0) -> dict[str, Any]:
    level = {
        "concurrency": 16,
        "requests": 32,
        "failed": failed,
        "early_stops": early,
        "tokens_exact": True,
        "agg_tok_s": agg16,
        "latency_p50_s": 1.0,
        "latency_p99_s": 2.0,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.2,
    }
    single = {"requests": 2, "failed": 0, "early_stops": 0, "decode_tok_s": decode, "ttft_s": 0.05}
    prefill = [{"length": 512, "prompt_tokens": 510, "seconds": 1.0, "tok_s": 510.0, "error": None}]
    return {"single": single, "levels": [level], "prefill": prefill}


def test_system_figures_are_medians_over_rounds_plus_memory_and_startup() -> None:
    system = {
        "passes": [server_pass(60.0, 300.0), server_pass(80.0, 500.0)],
        "peak_rss_mb": 900.0,
        "startup_first_s": 12.0,
        "startup_s": [2.0, 3.0, 4.0],
    }
    figures = run.system_figures(system)
    assert figures["decode_tok_s"] == 70.0 and figures["c16_agg_tok_s"] == 400.0
    assert figures["prefill512_tok_s"] == 510.0
    assert figures["peak_rss_mb"] == 900.0 and figures["startup_first_s"] == 12.0 and figures["startup_s"] == 3.0


def test_a_transformers_batch_fills_the_clients_row_of_its_batch_size() -> None:
    hf = {
        "dtype": "bfloat16",
        "decode_tok_s": 17.0,
        "ttft_s": 0.1,
        "batch16_agg_tok_s": 150.0,
        "batch": 16,
        "peak_rss_mb": 2000.0,
        "load_s": 3.0,
    }
    figures = run.system_figures({"passes": [hf, hf]})
    assert figures == {"decode_tok_s": 17.0, "ttft_s": 0.1, "c16_agg_tok_s": 150.0, "peak_rss_mb": 2000.0}


def test_notes_name_failures_and_early_stops() -> None:
    refused = server_pass(60.0, 300.0, early=3, failed=1)
    refused["prefill"].append({"length": 8000, "tok_s": None, "error": "HTTP 400: context full"})
    notes = run.notes({"peer": {"passes": [refused]}})
    assert "peer, round 1, 8000-token prefill failed: HTTP 400: context full" in notes
    assert any("peer, round 1, 16 clients: 1 of 32 requests failed" in n for n in notes)
    assert any("3 requests stopped before max_tokens" in n for n in notes)


def test_each_pass_of_a_managed_run_has_a_server_of_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two rounds start tokenmill twice: a start-up time and a pass per round, and one peak RSS over both servers."""
    out = tmp_path / "run.json"
    argv = ["bench", "--model", str(tiny_model_dir), "--rounds", "2", "--single-runs", "1", "--no-startup"]
    argv += ["--concurrency", "2", "--requests", "2", "--max-tokens", "6", "--prefill-tokens", "16", "--json", str(out)]
    assert main(argv) == 0
    system = json.loads(out.read_text())["systems"]["tokenmill"]
    assert len(system["startup_s"]) == 2 and all(s > 0 for s in system["startup_s"])
    assert len(system["passes"]) == 2 and all(p["levels"][0]["concurrency"] == 2 for p in system["passes"])
    assert system["peak_rss_mb"] > 0
