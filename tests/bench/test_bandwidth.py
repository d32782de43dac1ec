"""The bandwidth limit: the measurement, a file's weight bytes, and each system's share of the limit in a run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.bench.fake_openai import FakeOpenAI
from tests.gguf_writer import write_gguf_file
from tests.memory_maps import linux_only, vm_flags
from tests.tiny_model import write_tiny_gguf
from tokenmill.bench import bandwidth, run
from tokenmill.bench.load import LoadSettings, bench_url
from tokenmill.cli import main

SETTINGS = LoadSettings(max_tokens=4, eos_ids=None, single_runs=1, concurrency=(1,), requests=2)


def test_the_measurement_is_a_finite_speed_and_leaves_torch_threads_as_they_were() -> None:
    threads = torch.get_num_threads()
    gb_s = bandwidth.measure_read_gb_s(size_bytes=32 << 20, repeats=2, threads=1)
    assert 0 < gb_s < math.inf and torch.get_num_threads() == threads
    again = bandwidth.measure_read_gb_s(repeats=2, threads=1, over=torch.ones(8 << 20))  # a tensor kept for the loop
    assert 0 < again < math.inf and torch.get_num_threads() == threads


@linux_only
def test_the_sum_reads_memory_held_as_the_weights_are() -> None:
    summed = bandwidth.read_buffer(8 << 20)
    assert summed.dtype == torch.float32 and summed.numel() == 2 << 20 and float(summed.sum()) == 2 << 20
    assert "hg" in vm_flags(summed.data_ptr())  # advised for huge pages, as model/gguf_linear.py's Regrouping's


@pytest.mark.parametrize("quantize", [False, True])
def test_a_gguf_files_weight_bytes_are_its_tensors_data(tmp_path: Path, quantize: bool) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", quantize=quantize)
    expected = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)  # the gguf package's own count
    assert bandwidth.gguf_weight_bytes(str(path)) == expected > 0


def test_a_table_beside_a_head_of_its_own_is_not_read_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = [
        (name, rng.standard_normal((64, 32), dtype=np.float32)) for name in ("token_embd.weight", "output.weight")
    ]
    tensors.append(("blk.0.ffn_up.weight", rng.standard_normal((16, 32), dtype=np.float32)))
    path = write_gguf_file(tmp_path / "untied.gguf", "llama", lambda w: None, tensors)
    assert bandwidth.gguf_weight_bytes(str(path)) == (64 * 32 + 16 * 32) * 4


def test_the_limit_is_bandwidth_over_bytes() -> None:
    assert bandwidth.limit_tok_s(20.0, 500_000_000) == pytest.approx(40.0)


def _server_pass(decode_tok_s: float, gb_s: list[float] | None) -> dict[str, object]:
    """What bench_url returns, as far as the share reads it: the single stream's decode and the bandwidth around it."""
    single: dict[str, object] = {"decode_tok_s": decode_tok_s}
    if gb_s is not None:
        single["memory_read_gb_s"] = gb_s
    return {"single": single, "levels": []}


def test_each_pass_is_held_to_the_bandwidth_measured_around_it(tmp_path: Path) -> None:
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    weight_bytes = bandwidth.gguf_weight_bytes(path)
    systems = {  # a fast pass while the machine was slow, a slower one while it was fast
        "a": {"passes": [_server_pass(40.0, [10.0, 14.0]), _server_pass(50.0, [30.0, 34.0])]},
        "b": {"passes": [_server_pass(20.0, [20.0, 20.0])]},
    }
    figures: dict[str, dict[str, float | None]] = {"a": {"decode_tok_s": 45.0}, "b": {"decode_tok_s": 20.0}}
    meta = run._bandwidth_limit(figures, systems, path)
    assert meta == {
        "memory_read_gb_s": 20.0,  # the median of every figure
        "memory_read_gb_s_range": [10.0, 34.0],
        "memory_read_pages": "huge",  # what bandwidth.read_buffer holds the sum's gigabyte in
        "weight_bytes": weight_bytes,
        "bandwidth_limit_tok_s": 20e9 / weight_bytes,
    }
    shares = [40.0 / (12e9 / weight_bytes), 50.0 / (32e9 / weight_bytes)]  # each against the mean around it
    assert figures["a"]["bandwidth_share"] == pytest.approx((shares[0] + shares[1]) / 2)  # then their median
    assert figures["b"]["bandwidth_share"] == pytest.approx(20.0 / (20e9 / weight_bytes))


def test_a_pass_without_its_own_measurement_is_held_to_the_runs_median(tmp_path: Path) -> None:
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    limit = 20e9 / bandwidth.gguf_weight_bytes(path)
    systems = {
        "a": {"passes": [{"decode_tok_s": 50.0, "batch": 4}]},  # the transformers baseline's pass: no measurement
        "b": {"passes": [_server_pass(1.0, None)]},
        "c": {"passes": [_server_pass(1.0, [10.0, 30.0]), _server_pass(1.0, [20.0, 20.0])]},  # the median: 20 GB/s
    }
    figures: dict[str, dict[str, float | None]] = {"a": {"decode_tok_s": 50.0}, "b": {"decode_tok_s": None}}
    run._bandwidth_limit(figures, systems, path)
    assert figures["a"]["bandwidth_share"] == pytest.approx(50.0 / limit) and figures["b"]["bandwidth_share"] is None
    unmeasured = {"b": {"passes": [_server_pass(1.0, None)]}}  # --no-bandwidth: none measured
    assert run._bandwidth_limit({"b": {"decode_tok_s": 1.0}}, unmeasured, path) == {}


def test_a_run_on_a_gguf_measures_around_each_single_stream_and_prints_the_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeOpenAI()
    sent_before: list[int] = []  # the completions sent before each measurement
    figures = iter([10.0, 12.0, 30.0, 32.0])
    monkeypatch.setattr(bandwidth, "measure_read_gb_s", lambda: sent_before.append(len(fake.bodies)) or next(figures))
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    out = tmp_path / "bench.json"
    with fake.running() as url:
        argv = ["bench", "--url", url, "--model", path, "--requests", "4", "--max-tokens", "8", "--prefill-tokens"]
        assert main([*argv, "--concurrency", "1", "--single-runs", "2", "--rounds", "2", "--json", str(out)]) == 0
    # a round: the warm-up, a measurement, the two single-stream requests, a measurement, the level's four requests
    assert sent_before == [1, 3, 8, 10] and len(fake.bodies) == 14
    printed = capsys.readouterr().out
    assert "memory read 21.0 GB/s, 10.0–32.0" in printed and "share of bandwidth limit" in printed
    result = json.loads(out.read_text())
    assert [p["single"]["memory_read_gb_s"] for p in result["systems"]["server"]["passes"]] == [[10, 12], [30, 32]]
    meta = result["meta"]
    assert meta["memory_read_gb_s"] == 21.0 and meta["weight_bytes"] == bandwidth.gguf_weight_bytes(path)


def test_no_measurement_without_a_file_or_with_no_bandwidth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def never() -> float:
        raise AssertionError("nothing to set a limit with: no measurement")

    monkeypatch.setattr(bandwidth, "measure_read_gb_s", never)
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    with FakeOpenAI().running() as url:
        argv = ["bench", "--url", url, "--requests", "4", "--max-tokens", "8", "--concurrency", "1"]
        assert main(argv) == 0
        assert main([*argv, "--model", path, "--no-bandwidth"]) == 0
    assert "memory read" not in capsys.readouterr().out


def test_a_server_that_reports_its_weight_bytes_gets_them_in_the_table_and_a_peer_gets_the_files(
    tmp_path: Path,
) -> None:
    with FakeOpenAI(weight_bytes=270_000_000).running() as url:
        ours = asyncio.run(bench_url(url, SETTINGS))
    with FakeOpenAI(peer_like=True).running() as url:
        theirs = asyncio.run(bench_url(url, SETTINGS))
    assert ours["weight_bytes_per_token"] == 270_000_000 and theirs["weight_bytes_per_token"] is None
    figures = {
        "tokenmill": run.system_figures({"passes": [ours]}),
        "llama-server": run.system_figures({"passes": [theirs]}),
    }
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    run._bandwidth_limit(figures, {"measured": {"passes": [_server_pass(1.0, [20.0, 20.0])]}}, path)
    assert figures["tokenmill"]["weights_read_mb"] == 270.0
    assert figures["llama-server"]["weights_read_mb"] == bandwidth.gguf_weight_bytes(path) / 1e6
