"""What a start begins before it imports torch and the server (server/hash_ahead.py, server/start.py): each model's
weight files hashed on threads of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.config import Config
from tokenmill.server import hash_ahead
from tokenmill.server.hash_ahead import hash_models_ahead


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
    """The imports after it hold the GIL for over a second, and hashing needs none: so hashing comes first."""
    code = (
        "import sys\n"
        "from tokenmill import cli\n"
        "from tokenmill.server import start\n"
        "def begun(config):\n"
        "    heavy = ('torch', 'uvicorn', 'fastapi', 'tokenmill.api.app', 'tokenmill.engine.engine')\n"
        "    print(sorted(m for m in heavy if m in sys.modules))\n"
        "    raise SystemExit(0)\n"
        "start.hash_models_ahead = begun\n"
        "cli.main(['serve'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
