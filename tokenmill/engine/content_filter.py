"""The content filter: text no prompt may contain and no output may show (`--content-filter FILE`).

The file holds one pattern a line: a literal string, or a regular expression after a `re:` prefix (the `regex`
module's syntax; `re:(?i)...` ignores case). Blank lines are skipped. A prompt that contains a match is refused
(api/); an output stops just before its first match with finish_reason "content_filter" (FilterChecker, below).

Streaming must never show a match's first characters before the rest arrives, so the checker holds back text that
could still grow into a match, as StopChecker does for stop strings. For regular expressions "could still grow" is
answered by the `regex` module's partial matching: `search(text, partial=True)` reports a match that runs into the
end of the text and might complete with more of it. Assertions at the end (`\\b`, `$`) are judged on the text so far,
so a pattern like `re:\\bword\\b` stops an output at "word" even if "s" would have followed: it errs towards blocking.

Logprobs carry text too: the alternatives the model weighed at each position. AlternativesChecker drops those that,
read after the text in front of them, would contain or complete a match (api/logprobs.py asks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import regex

REGEX_PREFIX = "re:"


class ContentFilterError(ValueError):
    """A filter file that cannot be used: unreadable, a bad regular expression, or a pattern that matches nothing."""


@dataclass(frozen=True)
class ContentFilter:
    pattern: regex.Pattern[str]  # every line as one alternation, tried at each position left to right
    count: int  # how many patterns the file holds

    @classmethod
    def from_lines(cls, lines: list[str], source: str = "content filter") -> ContentFilter:
        parts = []
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            part = line[len(REGEX_PREFIX) :] if line.startswith(REGEX_PREFIX) else regex.escape(line)
            try:
                compiled = regex.compile(part)
            except regex.error as exc:
                raise ContentFilterError(f"{source}, line {number}: bad regular expression: {exc}") from None
            if compiled.fullmatch(""):
                raise ContentFilterError(f"{source}, line {number}: the pattern matches empty text")
            parts.append(f"(?:{part})")
        if not parts:
            raise ContentFilterError(f"{source}: no patterns")
        return cls(regex.compile("|".join(parts)), len(parts))

    @classmethod
    def from_file(cls, path: str) -> ContentFilter:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ContentFilterError(f"content filter {path}: cannot read it: {exc}") from None
        return cls.from_lines(text.splitlines(), f"content filter {path}")

    def matches(self, text: str) -> bool:
        return self.pattern.search(text) is not None

    def checker(self, context: str = "") -> FilterChecker:
        return FilterChecker(self, context)

    def alternatives(self, context: str = "") -> AlternativesChecker:
        return AlternativesChecker(self, context)


class FilterChecker:
    """One output's filter: feed text deltas, get back the text that is safe to show.

    `context` is text the client already has in front of the output (the prompt, when echoed): a match may begin in
    it, but it is never held back or returned. After a match, `matched` is set and nothing more is released; the
    output then ends where the match (or, for one that began in the context, the output) begins.
    """

    def __init__(self, content_filter: ContentFilter, context: str = "") -> None:
        self.pattern = content_filter.pattern
        self.text = context  # everything seen: the context, then the output (released and held)
        self.released = len(context)  # the text before this index has been shown
        self.scan_from = 0  # no match can begin before this index (everything before it was cleared)
        self.matched = False

    def feed(self, delta: str) -> str:
        if self.matched or not delta:
            return ""
        self.text += delta
        found = self.pattern.search(self.text, self.scan_from, partial=True)
        if found is None:  # the pattern could not even begin anywhere from here on
            return self._release(len(self.text))
        if found.partial:
            self.scan_from = found.start()  # a match may still grow from here: hold it back
        else:
            self.matched = True  # the output ends where the match begins
        return self._release(max(found.start(), self.released))

    def flush(self) -> str:
        """The output ended for another reason: held text is shown unless it completes a match as it stands."""
        if self.matched:
            return ""
        found = self.pattern.search(self.text, self.scan_from)
        if found is not None:
            self.matched = True
            return self._release(max(found.start(), self.released))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        released, self.released = self.text[self.released : upto], upto
        return released


_LOOKBEHIND = 64  # characters kept before the earliest possible match, for assertions (`\\b`, lookbehinds) to read


class AlternativesChecker:
    """Which alternative tokens may be shown after a text: those that, read right after it, neither contain a match
    nor complete one that began in it (a token "den" after "... forbid" is dropped when "forbidden" is filtered).

    A token is one position's guess, not text that grows, so a token that merely begins a match is shown. The text
    in front (`extend`) is kept only from where a match could still begin, so each check reads a short tail.
    """

    def __init__(self, content_filter: ContentFilter, context: str = "") -> None:
        self.pattern = content_filter.pattern
        self.tail = ""  # the end of the text so far: no match can begin before scan_from
        self.scan_from = 0
        self.extend(context)

    def extend(self, text: str) -> None:
        """`text` follows the text so far: it is what the client was shown there."""
        if not text:
            return
        self.tail += text
        found = self.pattern.search(self.tail, self.scan_from, partial=True)
        self.scan_from = len(self.tail) if found is None else found.start()
        cut = max(self.scan_from - _LOOKBEHIND, 0)
        self.tail, self.scan_from = self.tail[cut:], self.scan_from - cut

    def allows(self, *texts: str) -> bool:
        """Whether an alternative may be shown; `texts`: each way it reads (as shown, as decoded in context)."""
        return all(not text or self.pattern.search(self.tail + text, self.scan_from) is None for text in set(texts))
