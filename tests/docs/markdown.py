"""Just enough Markdown for the docs checks: fenced code blocks, the prose around them, and headings as GitHub
anchors them.

The prose view keeps every line in place (code blocks blanked, inline code spans replaced by spaces), so a check that
reads it reports the line a reader sees in the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(?:=+|-+)[ \t]*$")
LIST_OR_QUOTE = re.compile(r"^ {0,3}(?:[-*+]|[0-9]+[.)])[ \t]|^ {0,3}>")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # 1-based, the opening fence's
    end: int  # 1-based, the closing fence's (the file's last line if it has none)
    info: str  # the info string after the fence: "python", "bash", ...
    text: str
    before: str  # the line just above the opening fence ("" at the top of the file)

    @property
    def language(self) -> str:
        return self.info.split()[0].lower() if self.info.split() else ""


def code_blocks(path: Path) -> list[CodeBlock]:
    """Every fenced block; an unclosed fence runs to the end of the file, as CommonMark has it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None or (opening[1][0] == "`" and "`" in opening[2]):
            i += 1
            continue
        end = _closing_fence(lines, i, opening[1])
        before = lines[i - 1] if i > 0 else ""
        text = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(CodeBlock(path, i + 1, min(end + 1, len(lines)), opening[2].strip(), text, before))
        i = end + 1
    return blocks


def _closing_fence(lines: list[str], start: int, fence: str) -> int:
    for j in range(start + 1, len(lines)):
        closing = FENCE.match(lines[j])
        if closing and closing[1][0] == fence[0] and len(closing[1]) >= len(fence) and not closing[2].strip():
            return j
    return len(lines)


def prose_lines(path: Path) -> list[str]:
    """The file's lines with fenced blocks blanked and inline code spans turned to spaces (same count, same places)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for block in code_blocks(path):
        lines[block.line - 1 : block.end] = [""] * (block.end - block.line + 1)
    return [INLINE_CODE.sub(lambda m: " " * len(m[0]), line) for line in lines]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the file's headings (a repeated one gets -1, -2, ...), and any <a name|id="...">."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    raw = path.read_text(encoding="utf-8").splitlines()
    lines = prose_lines(path)
    for k, line in enumerate(lines):
        anchors.update(HTML_ANCHOR.findall(line))
        if (heading := _heading_text(raw, lines, k)) is None:
            continue
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _heading_text(raw: list[str], prose: list[str], k: int) -> str | None:
    """The source text of the heading on line k (inline code included), or None if line k is not a heading."""
    if ATX_HEADING.match(prose[k]) and (atx := ATX_HEADING.match(raw[k])):
        return atx[1] or ""
    if not (prose[k].strip() and k + 1 < len(prose) and SETEXT_UNDERLINE.match(prose[k + 1])):
        return None
    if LIST_OR_QUOTE.match(prose[k]):
        return None  # a list item or quote above a rule: the underline is a rule or plain text, not a heading
    first = k
    while first > 0 and prose[first - 1].strip() and not ATX_HEADING.match(prose[first - 1]):
        first -= 1  # an underlined heading is the whole paragraph above the line
    return " ".join(line.strip() for line in raw[first : k + 1])


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, everything but letters, digits, spaces, hyphens
    and underscores dropped, spaces turned to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image reads as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
