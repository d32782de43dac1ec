"""What a start begins before it imports torch and the server (server/hash_ahead.py, server/start.py): each model's
weight files hashed on threads of their own, and the huge pages of the GGUF weights the kernels will take backed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.config import Config
from tokenmill.server import hash_ahead
from tokenmill.server.hash_ahead import back_weights_of_models_ahead, hash_models_ahead


def test_serve_begins_hashing_each_models_files_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    begun: list[Path] = []
    monkeypatch.setattr(hash_ahead, "hash_ahead", lambda path, root: begun.append(path))
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"x")
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("model-00002.safetensors", "model-00001.safetensors", "config.json"):
        (hf / name).write_bytes(b"{}")
    hash_models_ahead(Config(model=[f"a={gguf}", f"b={hf}"], cache_dir=str(tmp_path / "cache")))
    assert begun == [gguf, hf / "model-00001.safetensors", hf / "model-00002.safetensors"]


def test_serve_begins_hashing_before_it_imports_torch_or_the_server() -> None:
    """The imports after it hold the GIL for over a second, and hashing and backing pages need none: so they come
    first."""
    code = (
        "import sys\n"
        "from tokenmill import cli\n"
        "from tokenmill.server import start\n"
        "backing = start.back_weights_of_models_ahead\n"
        "def begun(config):\n"
        "    backing(config)\n"
        "    heavy = ('torch', 'uvicorn', 'fastapi', 'tokenmill.api.app', 'tokenmill.engine.engine')\n"
        "    print(sorted(m for m in heavy if m in sys.modules))\n"
        "    raise SystemExit(0)\n"
        "start.hash_models_ahead = lambda config: None\n"
        "start.back_weights_of_models_ahead = begun\n"
        "cli.main(['serve'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_serve_backs_the_pages_of_the_gguf_weights_the_kernels_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backed: list[Path] = []
    monkeypatch.setattr(hash_ahead, "back_weights_ahead", backed.append)
    gguf, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    gguf.write_bytes(b"x")
    other.write_bytes(b"y")
    hf = tmp_path / "hf"
    hf.mkdir()
    models = [f"a={gguf}", f"h={hf}", f"b={other}"]
    back_weights_of_models_ahead(Config(model=models, cache_dir=str(tmp_path / "cache")))
    assert backed == [gguf, other]  # in load order; a Hugging Face directory's weights stay in torch's memory
    backed.clear()
    back_weights_of_models_ahead(Config(model=models, quantization="int8", cache_dir=str(tmp_path / "cache")))
    assert backed == []  # int8 weights are not the file's blocks
    back_weights_of_models_ahead(Config(model=models, dtype="float32", cache_dir=str(tmp_path / "cache")))
    assert backed == []  # float32 runs unquantised
