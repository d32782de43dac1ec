"""Stop strings with hold-back: text that could still turn into a stop string is not released yet.

Feed text deltas, get back the text that is safe to show. When a stop string appears, everything from its first
character on is cut and the checker reports that it matched.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.held = ""  # text not yet released: the tail that might begin a stop string
        self.matched = False

    def feed(self, delta: str) -> str:
        """Returns the releasable text; after a match, `matched` is True and nothing more is released."""
        if self.matched or not delta:
            return ""
        text = self.held + delta
        if not self.stop:
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.matched = True
            self.held = ""
            return text[:cut]
        keep = self._longest_partial_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The sequence ended for another reason: the held text turned out not to be a stop string."""
        text, self.held = self.held, ""
        return "" if self.matched else text

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
