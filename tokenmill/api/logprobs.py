"""OpenAI's legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset) from engine TokenLogprobs.

A token's string is the text it adds to the returned text, so `"".join(tokens)` is that text and `text_offset[i]` is
where `tokens[i]` begins in it. The engine names each token by decoding it alone, which is wrong for a byte-fallback
piece (half a character decodes to U+FFFD) and for decoders that look at neighbours, so the strings are decoded here
where the tokens stand (InContext) and then laid over the text the choice returns (`fit`).

One `LogprobsBuilder` per choice: it remembers what it has sent, so streamed fragments and the non-streamed whole
carry the same offsets. `-inf`/NaN never reach JSON: they become `MIN_LOGPROB`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.engine.content_filter import AlternativesChecker, ContentFilter
from tokenmill.engine.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # what a -inf (or NaN) logprob is reported as; JSON has no infinity
_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context, so the decoder sees each token's neighbours
_MAX_CHAR_BYTES = 4  # a window that starts inside a character starts at most 3 byte tokens too early


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class TokenView:
    """How one request's tokens are written out: the tokenizer that decodes them, whether special tokens are part of
    its text (skip_special_tokens), and the content filter that their alternatives must pass."""

    decoder: Decoder
    skip_special_tokens: bool = True
    content_filter: ContentFilter | None = None
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens and alternatives named "token_id:N"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def empty_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def extend_logprobs(into: dict[str, list[Any]], fragment: dict[str, list[Any]]) -> None:
    for key, values in fragment.items():
        into[key].extend(values)


def top_logprobs(entry: TokenLogprob, k: int) -> dict[str, float] | None:
    """Up to k alternatives plus the chosen token (so up to k+1 keys); several ids may share a text: keep the best."""
    if entry.logprob is None:
        return None
    best: dict[str, float] = {}
    for _, text, logprob in [*entry.top[:k], (entry.token_id, entry.text, entry.logprob)]:
        value = finite(logprob)
        if text not in best or value > best[text]:
            best[text] = value
    return dict(sorted(best.items(), key=lambda item: -item[1]))


class InContext:
    """Each token's text as it reads where it stands: decoded with the tokens before it, the text it completes.

    A token that leaves a character unfinished (a byte-fallback piece such as <0xF0>) reads as "", and the token that
    finishes it carries the whole character: engine/detok.py's rule, so the strings join to the text the engine
    returned. `peek` reads a token that might come next (an alternative) without taking it.
    """

    def __init__(self, decoder: Decoder, context: Sequence[int], skip_special_tokens: bool) -> None:
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.window = self._clean(list(context[-(_WINDOW + _MAX_CHAR_BYTES) :]))  # starts on a whole character
        self.pieces: deque[int] = deque([len(self.window)])  # the window's tokens, grouped by the text they made
        self.pending: list[int] = []  # tokens after the window that have made no text yet (half a character)
        self._prefix: dict[bool, str] = {}  # the window decoded, per skip_special_tokens

    def _clean(self, ids: list[int]) -> list[int]:
        """Drops a leading part of a character: byte-fallback decoders turn a whole run of bytes into U+FFFD when any
        of it is invalid, which would garble the text decoded after it."""
        for start in range(min(len(ids), _MAX_CHAR_BYTES)):
            if not self._decode(ids[start:], self.skip_special_tokens).startswith(_REPLACEMENT):
                return ids[start:]
        return ids[min(len(ids), _MAX_CHAR_BYTES) :]

    def peek(self, token_id: int, skip_special_tokens: bool | None = None) -> str:
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        prefix = self._prefix.get(skip)
        if prefix is None:
            prefix = self._prefix[skip] = self._decode(self.window, skip)
        full = self._decode([*self.window, *self.pending, token_id], skip)
        return "" if full.endswith(_REPLACEMENT) or len(full) <= len(prefix) else full[len(prefix) :]

    def add(self, token_id: int) -> str:
        text = self.peek(token_id)
        if not text:
            self.pending.append(token_id)
            return ""
        self.window += [*self.pending, token_id]
        self.pieces.append(len(self.pending) + 1)
        self.pending = []
        while len(self.window) - self.pieces[0] >= _WINDOW:
            del self.window[: self.pieces.popleft()]
        self._prefix = {}
        return text

    def flush(self) -> str:
        """The end: the text the pending tokens make after all (U+FFFD for a character that never finished)."""
        prefix = self._decode(self.window, self.skip_special_tokens)
        full = self._decode(self.window + self.pending, self.skip_special_tokens)
        self.pending = []
        return full[len(prefix) :]

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.decoder.decode(ids, skip_special_tokens=skip_special_tokens)


def fit(texts: Sequence[str], text: str) -> list[str]:
    """`text` cut into one string per token, following the tokens' own texts, so that the strings join to `text`.

    Where the decoded tokens and `text` agree, each token keeps its text. A token's text that `text` does not have
    is "": an added BOS, fill-in-the-middle tokens, an end token, a stop string or filter match cut from the output.
    Where `text` ends inside a token's text, the token keeps what is there. Where both go on but spell a stretch
    differently (a literal "▁" that the tokenizer reads as a space), the characters are taken position by position.
    Whatever of `text` is left at the end goes to the last token.
    """
    out: list[str] = []
    left = sum(map(len, texts))  # characters the tokens from here on decode to
    at = 0
    for token in texts:
        size = len(text) - at  # characters of `text` still to cover
        if text.startswith(token, at) or left == size:
            taken = text[at : at + len(token)]
        elif size < len(token) and token.startswith(text[at:]):
            taken = text[at:]
        else:
            taken = ""
        out.append(taken)
        at += len(taken)
        left -= len(token)
    if out and at < len(text):
        out[-1] += text[at:]
    return out


@dataclass
class _Token:
    entry: TokenLogprob  # as the engine reported it
    text: str  # decoded where it stands
    in_context: dict[int, str]  # alternatives decoded where they would stand (those whose own text needs it)


def _scan(
    entries: Iterable[TokenLogprob], reader: InContext, k: int, content_filter: ContentFilter | None
) -> list[_Token]:
    """Each entry with its text in context, and its alternatives' where they need it: every one when a filter reads
    them (a token's neighbours may make a match of it), else those whose own text is half a character."""
    tokens = []
    for entry in entries:
        in_context = {
            token_id: reader.peek(token_id, skip_special_tokens=False)
            for token_id, text, _ in entry.top[:k]
            if content_filter is not None or _REPLACEMENT in text
        }
        tokens.append(_Token(entry, reader.add(entry.token_id), in_context))
    return tokens


class LogprobsBuilder:
    """One choice's logprobs, a fragment at a time. A generated token is sent once the text it reads as has been
    returned, so a fragment never runs ahead of the text (a stop string may still hold its end back), and the last
    fragment fits what is left to what the choice returned: the stream joins to the same strings as the whole."""

    def __init__(self, top_k: int, view: TokenView, prompt_ids: Sequence[int], start: int = 0) -> None:
        self.top_k = top_k
        self.view = view
        self.offset = start  # characters of the choice's text (with the prompt's, without echo) already covered
        self.reader = InContext(view.decoder, prompt_ids, view.skip_special_tokens)
        self.text = ""  # the generated text returned so far
        self.covered = 0  # characters of it that sent tokens carry
        self.held: list[_Token] = []  # generated tokens not sent yet
        self.checker = self._checker("")

    def prompt(self, entries: Iterable[TokenLogprob], prompt_text: str, context: Sequence[int] = ()) -> dict[str, Any]:
        """Echoed prompt tokens (`context`: those before them that the echo leaves out). Their strings follow the
        echoed text, so "".join(tokens) is the returned text and `text_offset` an index into it."""
        reader = InContext(self.view.decoder, context, skip_special_tokens=False)  # as the prompt's text has them
        tokens = _scan(entries, reader, self.top_k, self.view.content_filter)
        if tokens:
            tokens[-1].text += reader.flush()
        fragment = self._render(tokens, fit([t.text for t in tokens], prompt_text), self._checker(""))
        self.after_prompt(prompt_text)
        return fragment

    def after_prompt(self, prompt_text: str) -> None:
        """Where the echoed prompt leaves the choice (what prompt() does besides its fragment, for a choice that takes
        the fragment another choice of the same prompt made)."""
        self.offset = len(prompt_text)
        self.checker = self._checker(prompt_text)  # with echo, generated alternatives read after the prompt

    def generated(self, entries: Iterable[TokenLogprob], text: str = "", final: bool = False) -> dict[str, Any]:
        """The next generated tokens and the text that came with them; `final`: the choice's last."""
        self.text += text
        self.held += _scan(entries, self.reader, self.top_k, self.view.content_filter)
        if final:
            if self.held:
                self.held[-1].text += self.reader.flush()
            ready, strings = len(self.held), fit([t.text for t in self.held], self.text[self.covered :])
        else:
            ready, at = 0, self.covered
            while ready < len(self.held) and self.text.startswith(self.held[ready].text, at):
                at += len(self.held[ready].text)
                ready += 1
            if self.view.content_filter is not None and ready:
                # the filter may cut the text inside the next token, which is then never reported: the text it
                # leaves before the cut goes to the token before it, so that one waits for the next
                ready -= 1
            strings = [t.text for t in self.held[:ready]]
        tokens, self.held = self.held[:ready], self.held[ready:]
        self.covered += sum(map(len, strings))
        return self._render(tokens, strings, self.checker)

    def _checker(self, context: str) -> AlternativesChecker | None:
        content_filter = self.view.content_filter
        return content_filter.alternatives(context) if content_filter is not None else None

    def _render(
        self, tokens: list[_Token], strings: list[str], checker: AlternativesChecker | None
    ) -> dict[str, list[Any]]:
        fragment = empty_logprobs()
        for token, string in zip(tokens, strings, strict=True):
            entry, shown = token.entry, _shown(token, string, checker)
            if self.view.as_token_ids:  # named by id; text_offset still indexes the text
                shown = _named_by_id(shown)
            fragment["tokens"].append(shown.text)
            fragment["token_logprobs"].append(None if entry.logprob is None else finite(entry.logprob))
            fragment["top_logprobs"].append(top_logprobs(shown, self.top_k))
            fragment["text_offset"].append(self.offset)
            self.offset += len(string)
            if checker is not None:
                checker.extend(string)
        return fragment


def _shown(token: _Token, string: str, checker: AlternativesChecker | None) -> TokenLogprob:
    """The entry as the client sees it: the chosen token as `string`, each alternative as it reads (in context where
    its own text is half a character), without those the content filter drops."""
    top = []
    for token_id, text, logprob in token.entry.top:
        if token_id == token.entry.token_id:
            top.append((token_id, string, logprob))
            continue
        in_context = token.in_context.get(token_id, text)
        if checker is not None and not checker.allows(text, in_context):
            continue
        top.append((token_id, in_context if _REPLACEMENT in text else text, logprob))
    return dataclasses.replace(token.entry, text=string, top=top)


def token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _named_by_id(entry: TokenLogprob) -> TokenLogprob:
    """vLLM's return_tokens_as_token_ids: a token and its alternatives as "token_id:N", so that tokens whose text is
    ambiguous (half a character, or several ids with one text) stay apart."""
    top = [(token_id, token_id_name(token_id), logprob) for token_id, _, logprob in entry.top]
    return dataclasses.replace(entry, text=token_id_name(entry.token_id), top=top)


def vllm_prompt_logprobs(
    entries: Sequence[TokenLogprob], k: int, view: TokenView | None = None, context: Sequence[int] = ()
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null where it has no context, else a map token id → {logprob, rank,
    decoded_token} holding the prompt token itself and the k likeliest tokens. With a content filter, an alternative
    that would contain or complete a match after the prompt's tokens before it is left out (`context`: tokens before
    `entries` that the client did not send)."""
    allowed = _allowed_prompt_alternatives(entries, k, view, context)
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, entry in enumerate(entries):
        if entry.logprob is None:
            out.append(None)
            continue
        position = {str(entry.token_id): _vllm_entry(entry.logprob, entry.rank, entry.text)}
        for rank, (token_id, text, logprob) in enumerate(entry.top[:k], start=1):
            if allowed is None or token_id in allowed[i]:
                position.setdefault(str(token_id), _vllm_entry(logprob, rank, text))
        out.append(position)
    return out


def _allowed_prompt_alternatives(
    entries: Sequence[TokenLogprob], k: int, view: TokenView | None, context: Sequence[int]
) -> list[set[int]] | None:
    """Per position, the ids of the alternatives that pass the content filter (None: there is no filter)."""
    if view is None or view.content_filter is None:
        return None
    checker = view.content_filter.alternatives()
    allowed = []
    for token in _scan(entries, InContext(view.decoder, context, skip_special_tokens=False), k, view.content_filter):
        top = token.entry.top[:k]
        allowed.append({i for i, text, _ in top if checker.allows(text, token.in_context.get(i, text))})
        checker.extend(token.text)
    return allowed


def _vllm_entry(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": text}
