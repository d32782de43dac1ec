"""ik_llama.cpp's server as a peer: a binary built by hand, llama-server's command line plus its CPU flags, a clear
refusal without a binary, and a run side by side on stand-ins (the fake OpenAI server in place of each process)."""

from __future__ import annotations

import argparse
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.bench.fake_openai import FakeOpenAI
from tokenmill.bench import ik_llama, run
from tokenmill.bench.flags import add_bench_arguments
from tokenmill.bench.servers import ServerSpec, ServerStartError
from tokenmill.cli import main


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    """A stand-in for a built ik_llama.cpp server: it only says its version."""
    path = tmp_path / "ik" / "llama-server"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\necho 'version: 3900 (ik0c0de)' >&2\necho 'built with cc 13 for x86_64' >&2\n")
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def no_binary_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ik_llama.ENV, raising=False)


def test_it_is_started_with_llama_servers_command_line_plus_its_cpu_flags(binary: Path) -> None:
    assert "ik-llama-server" not in bench_args("--compare").peers  # only when asked for
    args = bench_args("--compare", "--peers", "ik-llama-server", "--ik-llama-server", str(binary))
    args.peer_threads, args.llama_server_slots, args.ik_llama_server_args = 3, 8, "--no-mmap"
    spec = run._peer(args, "ik-llama-server", "/m.gguf")
    argv = list(spec.argv)
    assert spec.name == "ik-llama-server" and argv[0] == str(binary) and spec.ready_path == "/health"
    assert argv[argv.index("--threads") + 1] == argv[argv.index("--threads-batch") + 1] == "3"
    assert argv[argv.index("--parallel") + 1] == "8" and argv[argv.index("--ctx-size") + 1] == str(8 * 4096)
    assert argv[argv.index("--alias") + 1] == "m" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[-4:] == ["-rtr", "-fa", "on", "--no-mmap"]


def test_the_environment_names_the_binary_when_the_flag_does_not(binary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ik_llama.ENV, str(binary))
    assert ik_llama.ik_llama_binary(None) == binary
    assert ik_llama.ik_llama_binary(binary.parent / "llama-server") == binary.parent / "llama-server"


@pytest.mark.parametrize("given", [None, "/nowhere/llama-server"])
def test_without_a_binary_the_run_stops_at_once_saying_how_to_build_it(
    given: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def nothing_may_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may be built or started")

    monkeypatch.setattr(run, "ensure_llama_server", nothing_may_start)
    monkeypatch.setattr(run, "ManagedServer", nothing_may_start)
    argv = ["bench", "--compare", "--peers", "llama-server", "ik-llama-server", "--synthetic", "gemma3-1b"]
    assert main([*argv, *(["--ik-llama-server", given] if given else [])]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("tokenmill bench: ik-llama-server: ") and (given or "--ik-llama-server PATH") in line
    assert ik_llama.BUILD in line and "github.com/ikawrakow/ik_llama.cpp" in line
    with pytest.raises(ServerStartError):
        ik_llama.ik_llama_binary(Path(__file__))  # a file, but not an executable one


class StandIn:
    """A ManagedServer whose process is a fake OpenAI server on a thread of this one."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.url = ""
        self.peak_rss_mb = {"tokenmill": 900.0}.get(spec.name, 700.0)
        self._running: AbstractContextManager[str] | None = None
        self.fake = FakeOpenAI()

    def start(self, timeout_s: float) -> float:
        self.fake = FakeOpenAI(step_s=0.001 if self.spec.name == "tokenmill" else 0.002)
        self._running = self.fake.running()
        self.url = self._running.__enter__()
        return 1.0

    def stop(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
            self._running = None


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "ManagedServer", StandIn)


def test_a_run_puts_it_beside_tokenmill_with_its_version(binary: Path, tmp_path: Path, stand_ins: None) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--compare", "--peers", "ik-llama-server", "--model", str(tmp_path / "m.gguf")]
    argv += ["--ik-llama-server", str(binary), "--no-startup", "--no-bandwidth", "--rounds", "1"]
    argv += ["--requests", "2", "--max-tokens", "4", "--concurrency", "2", "--single-runs", "1", "--json", str(out)]
    assert main(argv) == 0
    results: dict[str, Any] = json.loads(out.read_text())
    assert list(results["figures"]) == ["tokenmill", "ik-llama-server"]
    assert results["figures"]["ik-llama-server"]["c2_agg_tok_s"] > 0
    assert results["ratios"]["tokenmill/ik-llama-server"]["peak_rss_mb"] == pytest.approx(900 / 700)
    peer = results["meta"]["peers"]["ik-llama-server"]
    assert peer == {
        "version": "version: 3900 (ik0c0de); built with cc 13 for x86_64",
        "build": f"built by hand: {binary}",
    }
    assert list(results["meta"]["peers"]) == ["ik-llama-server"]


def test_prompts_longer_than_a_slot_are_timed_for_everyone_on_servers_started_for_them(
    binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[StandIn] = []

    class Recorded(StandIn):
        def start(self, timeout_s: float) -> float:
            started.append(self)
            return super().start(timeout_s)

    monkeypatch.setattr(run, "ManagedServer", Recorded)
    out = tmp_path / "bench.json"
    argv = ["bench", "--compare", "--peers", "ik-llama-server", "--model", str(tmp_path / "m.gguf")]
    argv += ["--ik-llama-server", str(binary), "--no-startup", "--no-bandwidth", "--rounds", "2"]
    argv += ["--requests", "1", "--max-tokens", "4", "--concurrency", "1", "--single-runs", "1", "--json", str(out)]
    argv += ["--llama-server-ctx", "512", "--prefill-tokens", "100", "1000"]
    assert main(argv) == 0
    names = [s.spec.name for s in started]
    # a server per pass of the load, one way and then back, then one each for the long prompts
    assert names == ["tokenmill", "ik-llama-server", "ik-llama-server", "tokenmill", "tokenmill", "ik-llama-server"]
    one_slot = started[5].spec.argv
    assert one_slot[one_slot.index("--parallel") + 1] == "1" and one_slot[one_slot.index("--ctx-size") + 1] == "2048"
    long_bodies = [b for b in started[4].fake.bodies if len(str(b["prompt"]).split()) > 500]
    assert (
        len(long_bodies) == 2
        and not any(  # the servers that took the load never saw the long prompts
            len(str(b["prompt"]).split()) > 500 for s in started[:4] for b in s.fake.bodies
        )
    )
    results: dict[str, Any] = json.loads(out.read_text())
    for name in ("tokenmill", "ik-llama-server"):
        for one_pass in results["systems"][name]["passes"]:
            assert [p["length"] for p in one_pass["prefill"]] == [100, 1000]
            assert all(p["tok_s"] > 0 for p in one_pass["prefill"])
        assert results["figures"][name]["prefill1000_tok_s"] > 0
    assert results["figures"]["ik-llama-server"]["peak_rss_mb"] == 700.0  # the server that took the load
    assert results["figures"]["tokenmill"]["peak_rss_mb"] == 900.0
    notes = results["notes"]
    assert (
        "ik-llama-server, round 2: prompts longer than a slot timed on a server started for them (one slot of 2048 tokens)"
        in notes
    )
    assert "tokenmill, round 1: prompts longer than a slot timed on a server started for them" in notes
