"""The direction of imports between tokenmill's parts (docs/architecture.md, "Which way the imports run").

Every module's imports are read with `ast` (lazy imports inside functions included), so a wrong-way import fails here
even where it would not form a cycle at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"

# part → the other parts of tokenmill it may import ("" is the top-level package: tokenmill/__init__.py's version)
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "tokenizer": {"kernels"},  # token_splits.c, for a Gemma GGUF vocabulary's merges
    "config": set(),
    "model": {"kernels", "tokenizer", "config"},
    "engine": {"model", "kernels", "tokenizer", "config", ""},
    "api": {"engine", "config"},
    "cluster": {"api", "engine", "tokenizer", "config"},
    "bench": {"model", "config", "cluster"},
    "cli": {"api", "engine", "bench", "config", "cluster"},
}
# third-party modules a part must not use: the HTTP edge never touches tensors
FORBIDDEN_LIBRARIES = {"api": {"torch", "numpy"}}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem != "__init__" else ""


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "tokenmill":  # `from tokenmill import kernels` names a part; `__version__` does not
                names.update(f"tokenmill.{alias.name}" for alias in node.names if is_part(alias.name))
            if node.module.startswith("tests"):  # `from tests.e2e import conftest` names a module
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_part(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def tokenmill_part(module: str) -> str | None:
    if module == "tokenmill":
        return ""
    if module.startswith("tokenmill."):
        return module.split(".")[1]
    return None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) != "")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_the_documented_way(path: Path) -> None:
    part = part_of(path)
    assert part in ALLOWED, f"{part} is a new part of the tree: add it to ALLOWED and to docs/architecture.md"
    wrong = set()
    for module in imported_modules(path):
        target = tokenmill_part(module)
        if target is not None and target != part and target not in ALLOWED[part]:
            wrong.add(module)
        if module.split(".")[0] in FORBIDDEN_LIBRARIES.get(part, set()):
            wrong.add(module)
    assert not wrong, f"{path.relative_to(PACKAGE)} ({part}) imports {sorted(wrong)}"


def test_the_rules_catch_a_wrong_way_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from tokenmill import __version__, engine\ndef f():\n    from tokenmill.api.app import app\n")
    assert {tokenmill_part(m) for m in imported_modules(module)} == {"", "engine", "api"}
    assert "api" not in ALLOWED["engine"] and "engine" not in ALLOWED["model"] and not ALLOWED["kernels"]


TESTS = Path(__file__).resolve().parent
TEST_FILES = sorted(TESTS.rglob("*.py"))


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_tests_share_helpers_not_test_modules(path: Path) -> None:
    """Shared code lives in helper modules (tiny_model.py, api/api_helpers.py, e2e/server.py, ...): importing a test
    module or a conftest runs its collection-time code twice and couples unrelated tests."""
    wrong = {
        module
        for module in imported_modules(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith(("test_", "conftest"))
    }
    assert not wrong, f"{path.relative_to(TESTS)} imports {sorted(wrong)}"
