"""Every relative link in the README and docs/ leads somewhere inside the repository, and every #anchor to a heading.

A link is `[text](target)`, `![alt](target)` or a reference definition `[label]: target`, outside code blocks and
inline code. Its path (relative to the file, or to the repository with a leading `/`) must be a file or folder in the
repository; an anchor, alone or after a `.md` path, must be one GitHub gives a heading of that file (see
markdown.github_slug). http(s) and mailto links are left alone: there is no network here. A path into the folder
beside the repository (`../shared`) is refused even in code, since a reader of the repository does not have it.
"""

from __future__ import annotations

import os.path
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.docs.markdown import ROOT, github_slug, heading_anchors, prose_lines

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+[\"'(][^)]*)?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s+(<[^>]*>|\S+)")
EXTERNAL = ("http://", "https://", "mailto:")
OUTSIDE = "../shared"


def markdown_files(root: Path) -> list[Path]:
    """README.md, CHANGELOG.md and docs/**/*.md, those that exist."""
    top = [root / name for name in ("README.md", "CHANGELOG.md") if (root / name).is_file()]
    return top + sorted((root / "docs").rglob("*.md"))


def link_targets(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every link in the file's prose."""
    for number, line in enumerate(prose_lines(path), start=1):
        for match in [*INLINE_LINK.finditer(line), *REFERENCE_DEFINITION.finditer(line)]:
            yield number, match[1].removeprefix("<").removesuffix(">")


def broken_links(path: Path, root: Path) -> list[str]:
    """`file:line: target (why)` for each link of `path` that does not hold."""
    broken = []
    for number, target in link_targets(path):
        if target.startswith(EXTERNAL):
            continue
        if why := _why_broken(path, root, target):
            broken.append(f"{path.relative_to(root)}:{number}: {target} ({why})")
    return broken


def _why_broken(path: Path, root: Path, target: str) -> str | None:
    link_path, _, anchor = target.partition("#")
    if not link_path:
        destination = path
    else:
        base = root if link_path.startswith("/") else path.parent
        destination = Path(os.path.normpath(base / unquote(link_path).lstrip("/")))
        if not destination.is_relative_to(root):
            return "leaves the repository"
        if not destination.exists():
            return "no such file"
    if anchor and destination.suffix == ".md" and unquote(anchor) not in heading_anchors(destination):
        return f"no heading #{anchor} in {destination.relative_to(root)}"
    return None


def references_outside(path: Path, root: Path) -> list[str]:
    """`file:line: text` for each line, code included, that names a path in the folder beside the repository."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [f"{path.relative_to(root)}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if OUTSIDE in line]


FILES = markdown_files(ROOT)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_hold(path: Path) -> None:
    broken = broken_links(path, ROOT)
    assert not broken, "links that do not hold:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(path: Path) -> None:
    outside = references_outside(path, ROOT)
    assert not outside, f"paths into {OUTSIDE}, which a reader of the repository does not have:\n" + "\n".join(outside)


def test_the_files_checked_include_the_readme() -> None:
    assert ROOT / "README.md" in FILES


def _planted_repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "beside.md").write_text("# Beside\n")  # exists, but outside the repository
    (root / "docs" / "api.md").write_text("# The API\n\n## Errors\n\n## Errors\n\nStreams\n-------\n")
    (root / "README.md").write_text(
        "# Project\n\n## Use `it` now\n\n"
        "[api](docs/api.md) [errors](docs/api.md#errors-1) [streams](docs/api.md#streams) [here](#use-it-now)\n"
        "[site](https://example.com/missing.md) ![folder](docs) [root](/docs/api.md)\n"
        "```markdown\n[in a block](nowhere.md)\n```\n`[inline code](nowhere.md)`\n"
        "[gone](docs/missing.md)\n"
        "[away](../beside.md)\n"
        "[no heading](docs/api.md#nothing-here) [no local heading](#nothing)\n"
        "[ref]: docs/also-missing.md\n"
        "See `../shared/spec/`.\n"
    )
    return root


def test_the_link_check_reports_each_broken_link(tmp_path: Path) -> None:
    root = _planted_repository(tmp_path)
    assert broken_links(root / "README.md", root) == [
        "README.md:11: docs/missing.md (no such file)",
        "README.md:12: ../beside.md (leaves the repository)",
        "README.md:13: docs/api.md#nothing-here (no heading #nothing-here in docs/api.md)",
        "README.md:13: #nothing (no heading #nothing in README.md)",
        "README.md:14: docs/also-missing.md (no such file)",
    ]
    assert broken_links(root / "docs" / "api.md", root) == []


def test_the_outside_check_reports_a_path_beside_the_repository(tmp_path: Path) -> None:
    root = _planted_repository(tmp_path)
    assert references_outside(root / "README.md", root) == ["README.md:15: See `../shared/spec/`."]
    assert references_outside(root / "docs" / "api.md", root) == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Two commands", "two-commands"),
        ("vLLM's fields", "vllms-fields"),
        ("Request fields, from OpenAI's reference", "request-fields-from-openais-reference"),
        ("`tokenmill serve` and its `--model_dir`", "tokenmill-serve-and-its---model_dir"),
        ("Rate limits & **user**", "rate-limits--user"),
        ("See [the API](docs/api.md)", "see-the-api"),
        ("Ünïcode 3.11", "ünïcode-311"),
    ],
)
def test_anchors_are_slugged_as_github_does(heading: str, anchor: str) -> None:
    assert github_slug(heading) == anchor
