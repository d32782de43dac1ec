"""The project speaks of itself only: no text file in the repository says how it was developed.

Every text file git tracks (binary files and `tests/spec/`, a copy of an upstream reference, left out) is searched for
the words of a development diary: an ordinal or "this", "last", "next" before "session", a session or issue number,
a numbered stop, the machine a run was made on ("the VM" and "of"). "session" alone stays legitimate: a pytest
fixture's scope, a process session. The pattern is written so that its own text does not match it, and this file is
checked with the rest.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.docs.markdown import ROOT

# A space inside a phrase is written [ ], so that this file's own text holds none of them.
PROCESS_WORDS = re.compile(
    r"\b(?:first|second|third|(?!with\b)[a-z]+th|this|last|previous|next)[ ]session\b"  # "with": not an ordinal
    r"|\bsessions?[ ][0-9]+"  # a number, and so a range of them
    r"|\bissue[ ][0-9]+"
    r"|\bstop[ ][0-9]+"
    r"|\bVM[ ]of\b",
    re.IGNORECASE,
)
SKIPPED = ("tests/spec/",)  # the upstream reference, as published
NOT_WALKED = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def repository_files(root: Path) -> list[Path]:
    """The files git tracks; without git (a tree copied out of a clone), every file but caches and the venv."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return walked_files(root)
    return [root / name for name in listed.stdout.decode().split("\0") if name]


def walked_files(root: Path) -> list[Path]:
    files = []
    for folder, folders, names in os.walk(root):
        folders[:] = sorted(set(folders) - NOT_WALKED)  # os.walk descends into what is left
        files += [Path(folder, name) for name in sorted(names)]
    return files


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8) or one listed but not on disk."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def process_words(root: Path, files: list[Path]) -> list[str]:
    """`path:line: text` for each line that says how the project was developed."""
    hits = []
    for path in files:
        relative = path.relative_to(root).as_posix()
        if relative.startswith(SKIPPED) or (text := text_of(path)) is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{relative}:{number}: {line.strip()}")
    return hits


def test_the_repository_speaks_of_itself_only() -> None:
    hits = process_words(ROOT, repository_files(ROOT))
    assert not hits, "words about how the project was developed (say the fact without the history):\n" + "\n".join(hits)


def test_the_check_finds_each_kind_of_process_word(tmp_path: Path) -> None:
    phrases = ["In the twelfth_session we measured it.", "As the previous_Session found.", "sessions_3–5"]
    phrases += ["see issue_11", "at stop_4", "on the VM_of a neighbour"]
    planted = [phrase.replace("_", " ") for phrase in phrases]  # "_" for the space: this file holds none of them
    kept = ['@pytest.fixture(scope="session")', "a process in its own session", "with_session cookies", "VM offset"]
    kept = [phrase.replace("_", " ") for phrase in kept]  # spelt apart like the planted ones, for plainer scans
    (tmp_path / "notes.md").write_text("\n".join(planted + kept) + "\n")
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\0 " + planted[0].encode())
    (tmp_path / "tests" / "spec").mkdir(parents=True)
    (tmp_path / "tests" / "spec" / "reference.yaml").write_text(planted[0])
    files = repository_files(tmp_path)  # not a git repository: the walk
    assert process_words(tmp_path, files) == [f"notes.md:{n}: {line}" for n, line in enumerate(planted, start=1)]


def test_the_walk_without_git_skips_the_venv(tmp_path: Path) -> None:
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "site.py").write_text("x\n")
    (tmp_path / "kept.py").write_text("x\n")
    assert repository_files(tmp_path) == [tmp_path / "kept.py"]
