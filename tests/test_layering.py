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
    "engine": {"model", "kernels", "tokenizer"},  # no Config: a start sizes and wires it (server/)
    "api": {"engine", "config"},
    "server": {"api", "engine", "model", "tokenizer", "config", ""},  # the composition root: nothing below imports it
    "cluster": {"server", "api", "engine", "tokenizer", "config"},
    "bench": {"model", "config", "cluster", "kernels"},  # kernels: huge_pages, memory held as the weights are
    "cli": {"server", "api", "engine", "bench", "config", "cluster"},
}
# a part that may use only some modules of another: what it runs on, never how that part is put together
ONLY_MODULES: dict[tuple[str, str], set[str]] = {
    ("engine", "model"): {"causal_lm", "attention", "model_config", "lora"},  # the model's interface, no family's
    ("api", "engine"): {
        "outputs",
        "sampling",
        "guided",
        "content_filter",
        "stop",
    },  # values and checks, never the engine
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
            part = tokenmill_part(node.module)
            if part and node.module.count(".") == 1:  # `from tokenmill.engine import guided` names a module
                names.update(f"{node.module}.{alias.name}" for alias in node.names if is_part(part, alias.name))
            if node.module.startswith("tests"):  # `from tests.e2e import conftest` names a module
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_part(*names: str) -> bool:
    """Whether tokenmill/<names...> is a package or a module (`is_part("engine", "guided")`: engine/guided.py)."""
    path = PACKAGE.joinpath(*names)
    return path.is_dir() or path.with_suffix(".py").is_file()


def module_within(module: str) -> str | None:
    """The module inside its part: `tokenmill.engine.outputs` → "outputs"; None for a part itself."""
    names = module.split(".")
    return names[2] if len(names) > 2 and names[0] == "tokenmill" else None


def tokenmill_part(module: str) -> str | None:
    if module == "tokenmill":
        return ""
    if module.startswith("tokenmill."):
        return module.split(".")[1]
    return None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) != "")


def wrong_imports(path: Path, part: str) -> set[str]:
    """The modules `path` (a module of `part`) imports against the rules above."""
    wrong = set()
    for module in imported_modules(path):
        target = tokenmill_part(module)
        if target is not None and target != part and target not in ALLOWED[part]:
            wrong.add(module)
        within = module_within(module)
        if within is not None and within not in ONLY_MODULES.get((part, target or ""), {within}):
            wrong.add(module)
        if module.split(".")[0] in FORBIDDEN_LIBRARIES.get(part, set()):
            wrong.add(module)
    return wrong


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_the_documented_way(path: Path) -> None:
    part = part_of(path)
    assert part in ALLOWED, f"{part} is a new part of the tree: add it to ALLOWED and to docs/architecture.md"
    wrong = wrong_imports(path, part)
    assert not wrong, f"{path.relative_to(PACKAGE)} ({part}) imports {sorted(wrong)}"


def test_the_rules_catch_a_wrong_way_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from tokenmill import __version__, engine\ndef f():\n    from tokenmill.api.app import app\n")
    assert {tokenmill_part(m) for m in imported_modules(module)} == {"", "engine", "api"}
    assert "api" not in ALLOWED["engine"] and "engine" not in ALLOWED["model"] and not ALLOWED["kernels"]


def test_nothing_the_composition_root_wires_imports_it() -> None:
    assert [part for part, allowed in ALLOWED.items() if "server" in allowed] == ["cluster", "cli"]


def test_a_part_may_be_held_to_some_modules_of_another(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from tokenmill.model import causal_lm, gemma3\nfrom tokenmill.model.linear import Int8Linear\n")
    assert wrong_imports(module, "engine") == {"tokenmill.model.gemma3", "tokenmill.model.linear"}
    module.write_text("from tokenmill.engine.engine import AsyncEngine\nfrom tokenmill.engine import outputs\n")
    assert wrong_imports(module, "api") == {"tokenmill.engine.engine"}


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
