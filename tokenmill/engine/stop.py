"""Stop strings with hold-back: text that could still turn into a stop string is not released yet.

Feed text deltas, get back the text that is safe to show. When a stop string appears, everything from its first
character on is cut (or from just after it, with `include_stop`) and the checker reports which one matched.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: tuple[str, ...], include_stop: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.held = ""  # text not yet released: the tail that might begin a stop string
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str, check: bool = True) -> str:
        """Returns the releasable text; after a match, `matched` is set and nothing more is released.

        `check=False` (before min_tokens): the text is released without looking for stop strings."""
        if self.matched is not None or not delta:
            return ""
        text = self.held + delta
        if not self.stop or not check:
            self.held = ""
            return text
        found = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])  # the earliest; a tie: the first listed
            self.held = ""
            return text[: cut + len(self.matched)] if self.include_stop else text[:cut]
        keep = self._longest_partial_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The sequence ended for another reason: the held text turned out not to be a stop string."""
        text, self.held = self.held, ""
        return "" if self.matched is not None else text

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
