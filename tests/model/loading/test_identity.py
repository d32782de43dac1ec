"""A model file's identity: its SHA-256, remembered, and begun ahead of the load (identity.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tokenmill.model.loading import identity


@pytest.fixture(autouse=True)
def no_hashes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an empty table of hashes begun ahead, whatever another test's start left in it."""
    monkeypatch.setattr(identity, "_ahead", {})


def _counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = identity._hash_file

    def counted(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(identity, "_hash_file", counted)
    return hashed


@pytest.mark.parametrize("size", [0, 1, 1000, 10_000])
def test_the_hash_is_the_files_sha256_whatever_the_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(identity, "HASH_SLICE", 333)  # many slices, the last one short
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(size))
    assert identity.file_sha256(path, tmp_path / "cache") == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_is_hashed_once_and_again_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = _counting_hashes(monkeypatch)
    path, root = tmp_path / "model.gguf", tmp_path / "cache"
    path.write_bytes(b"weights")
    first = identity.file_sha256(path, root)
    assert identity.file_sha256(path, root) == first and len(hashed) == 1
    path.write_bytes(b"other weights")
    os.utime(path, ns=(1, 1))  # a new mtime as well as a new size
    assert identity.file_sha256(path, root) == hashlib.sha256(b"other weights").hexdigest() and len(hashed) == 2


def test_a_hash_begun_ahead_is_taken_not_begun_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = _counting_hashes(monkeypatch)
    path, root = tmp_path / "model.gguf", tmp_path / "cache"
    path.write_bytes(os.urandom(100_000))
    identity.hash_ahead(path, root)
    identity.hash_ahead(path, root)  # already under way: nothing more
    assert identity.file_sha256(path, root) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hashed == [path]
    identity.hash_ahead(path, root)  # remembered now: no thread, nothing in flight
    assert identity.file_sha256(path, root) and hashed == [path] and identity._ahead == {}


def test_a_missing_file_begins_nothing(tmp_path: Path) -> None:
    identity.hash_ahead(tmp_path / "absent.gguf", tmp_path / "cache")
    assert identity._ahead == {}
