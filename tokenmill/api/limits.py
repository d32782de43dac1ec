"""What one completion request may ask for: prompts, sequences, prompt tokens, the size of its response and its
running time, each a clear 400 naming the field.

The cheap checks run before any tokenisation: the counts, a constraint's size, and each text prompt's length against
the fewest tokens it can become (TextBound), so a text that cannot fit is refused without being tokenised. The
tokenising itself stops at the first prompt over its context or once the prompts pass the request's token limit
(CappedTokenizer): a request over its limits costs at most the tokens it may send. The response's size is estimated
once the prompts are known, before the engine is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from tokenmill.api import protocol
from tokenmill.api.engine_protocol import Tokenizer
from tokenmill.api.errors import APIError, context_length_exceeded, invalid_request
from tokenmill.api.prompts import Prompt, prompt_items
from tokenmill.api.protocol import CompletionRequest
from tokenmill.config import Config
from tokenmill.engine.guided import MAX_GUIDE_CHARS

# A tokenizer's normaliser can shrink text before it is split: NFC/NFKC compose at most 4 code points into one (ᾂ is
# α + three combining marks), and no normaliser of a model we load shrinks text more.
NORMALISED_SHRINK = 4
# The estimate of a response's bytes, per item, as its JSON spends them (a little over: an estimate that refuses a
# response which would have fitted by a few bytes does less harm than one that lets through a larger one).
CHOICE_BYTES = 256  # a choice's fixed fields
TEXT_BYTES_PER_TOKEN = 8  # a generated token's text (most tokens are a few characters)
TOKEN_ID_BYTES = 8  # one id of prompt_token_ids or token_ids, with its comma
LOGPROB_BYTES = 48  # a token in OpenAI's logprobs: its text, logprob and text_offset
TOP_LOGPROB_BYTES = 32  # one alternative in top_logprobs
PROMPT_LOGPROB_BYTES = 80  # one alternative in vLLM's prompt_logprobs: {"id": {"logprob", "rank", "decoded_token"}}


@dataclass(frozen=True)
class TextBound:
    """The fewest tokens a text can become with one tokenizer: each token stands for at most `chars_per_token`
    characters of the text as sent (the vocabulary's longest token, times NORMALISED_SHRINK), and BOS comes first
    where the tokenizer adds it."""

    chars_per_token: int
    adds_bos: bool

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TextBound:
        """A pass over the vocabulary: a worker thread's job for a large one."""
        longest = 1
        for token_id in range(tokenizer.vocab_size):
            try:
                longest = max(longest, len(tokenizer.id_to_token(token_id)))
            except KeyError:  # an id without a token (a hole in the vocabulary) stands for no text
                continue
        return cls(longest * NORMALISED_SHRINK, tokenizer.add_bos)

    def fewest_tokens(self, chars: int) -> int:
        return -(-chars // self.chars_per_token) + int(self.adds_bos)


@dataclass(frozen=True)
class RequestLimits:
    max_prompts: int = 2048
    max_choices: int = 4096  # prompts × max(n, best_of): the sequences one request makes the engine run
    max_prompt_tokens: int = 1 << 20
    timeout_s: float | None = None
    max_response_bytes: int = 64 << 20
    # each tokenizer's TextBound, found once (by id, with the tokenizer kept so that the id stays its own)
    _bounds: dict[int, tuple[Tokenizer, TextBound]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, config: Config) -> RequestLimits:
        return cls(
            max_prompts=config.max_prompts_per_request,
            max_choices=config.max_choices_per_request,
            max_prompt_tokens=config.max_prompt_tokens_per_request,
            timeout_s=config.request_timeout_s or None,
            max_response_bytes=config.max_response_bytes,
        )

    def known_bound(self, tokenizer: Tokenizer) -> TextBound | None:
        """The tokenizer's TextBound if it has been found (text_bound finds it)."""
        kept = self._bounds.get(id(tokenizer))
        return kept[1] if kept is not None and kept[0] is tokenizer else None

    def text_bound(self, tokenizer: Tokenizer) -> TextBound:
        bound = self.known_bound(tokenizer)
        if bound is None:
            bound = TextBound.of(tokenizer)
            self._bounds[id(tokenizer)] = (tokenizer, bound)
        return bound

    # --- before tokenising ------------------------------------------------------------------------------------------
    def check_counts(self, num_prompts: int, num_candidates: int) -> None:
        if num_prompts > self.max_prompts:
            raise invalid_request(
                f"Too many prompts: {num_prompts} in one request; this server takes at most {self.max_prompts}.",
                "prompt",
            )
        if num_prompts * num_candidates > self.max_choices:
            raise invalid_request(
                f"Too many sequences: {num_prompts} prompt(s) × {num_candidates} (n or best_of) = "
                f"{num_prompts * num_candidates}; this server generates at most {self.max_choices} per request.",
                "n",
            )

    def check_unprepared(self, request: CompletionRequest, bound: TextBound, max_model_len: int) -> int:
        """Every check the body alone allows, before anything is tokenised; returns the fewest prompt tokens the
        request's prompts can become (what a token rate limit charges for tokenising them)."""
        items = prompt_items(request.prompt)
        self.check_counts(len(items), request.num_candidates)
        _check_choices(request)
        suffix = len(request.suffix or "")
        keep = request.truncate_prompt_tokens
        fewest = []
        for item in items:
            if isinstance(item, str):
                tokens = check_text_length(len(item) + suffix, bound, max_model_len)
            else:
                tokens = len(item)
            fewest.append(tokens if keep is None else min(tokens, keep))
        if sum(fewest) > self.max_prompt_tokens:
            raise _too_many_prompt_tokens(sum(fewest), self.max_prompt_tokens, at_least=True)
        return sum(fewest)

    def capped(self, tokenizer: Tokenizer, request: CompletionRequest, max_model_len: int) -> Tokenizer:
        """`tokenizer` as the request's prompts are to be tokenised with: it stops them at the limits (CappedTokenizer)."""
        max_tokens = _max_tokens(request)
        return cast(
            Tokenizer, CappedTokenizer(tokenizer, self, max_model_len, max_tokens, request.truncate_prompt_tokens)
        )

    # --- once the prompts are tokenised -----------------------------------------------------------------------------
    def check_token_count(self, count: int, param: str) -> None:
        """/tokenize's and /detokenize's tokens: at most what one completion may send."""
        if count > self.max_prompt_tokens:
            raise invalid_request(
                f"Too many tokens: {count} or more; this server takes at most {self.max_prompt_tokens} in one request.",
                param,
            )

    def check_prompt_tokens(self, lengths: Sequence[int]) -> None:
        total = sum(lengths)
        if total > self.max_prompt_tokens:
            raise _too_many_prompt_tokens(total, self.max_prompt_tokens)

    def check_response(self, request: CompletionRequest, prompts: Sequence[Prompt]) -> None:
        """The response's bytes, estimated from what the prompts and the fields ask for: prompts × n choices, each
        with its echoed prompt, logprobs, prompt_logprobs and token ids, and max_tokens of text. Past the budget, a 400
        naming the field to lower: `n` when one choice per prompt would fit, else the part that weighs most."""
        parts = _response_parts(request, prompts)
        per_choice = sum(parts.values())
        n = request.num_choices
        if per_choice * n <= self.max_response_bytes:
            return
        param = "n" if n > 1 and per_choice <= self.max_response_bytes else max(parts, key=parts.__getitem__)
        raise invalid_request(
            f"The response would be too large: about {_size(per_choice * n)} for {len(prompts)} prompt(s) × {n} "
            f"choice(s); this server sends at most {_size(self.max_response_bytes)} for one request. "
            f"Lower '{param}'.",
            param,
            "response_too_large",
        )


class CappedTokenizer:
    """A tokenizer for one request's prompts, which counts what it encodes: the first prompt over its context (none
    with truncate_prompt_tokens), or the prompt that takes the request past its token limit, ends the tokenising with
    the 400 the request would get once every prompt was tokenised. Everything else is the tokenizer's own."""

    def __init__(
        self, tokenizer: Tokenizer, limits: RequestLimits, max_model_len: int, max_tokens: int, keep: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.keep = keep
        self.total = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._counted(self.tokenizer.encode(text, add_special_tokens))

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        return self._counted(self.tokenizer.encode_infill(prefix, suffix))

    def _counted(self, ids: list[int]) -> list[int]:
        if self.keep is None and len(ids) + self.max_tokens > self.max_model_len:
            raise context_length_exceeded(self.max_model_len, len(ids), self.max_tokens)
        self.total += len(ids) if self.keep is None else min(len(ids), self.keep)
        if self.total > self.limits.max_prompt_tokens:
            raise _too_many_prompt_tokens(self.total, self.limits.max_prompt_tokens, at_least=True)
        return ids


def _max_tokens(request: CompletionRequest) -> int:
    return request.max_tokens if request.max_tokens is not None else protocol.DEFAULT_MAX_TOKENS


def _check_choices(request: CompletionRequest) -> None:
    """structured_outputs.choice becomes one regex of every choice: bounded before it is built."""
    choices = request.structured_outputs.choice if request.structured_outputs is not None else None
    chars = sum(len(c) for c in choices or ())
    if chars > MAX_GUIDE_CHARS:
        raise invalid_request(
            f"'structured_outputs' cannot be used: its choices are {chars} characters together; this server takes "
            f"at most {MAX_GUIDE_CHARS}",
            "structured_outputs",
        )


def _response_parts(request: CompletionRequest, prompts: Sequence[Prompt]) -> dict[str, int]:
    """One choice per prompt's estimated bytes, summed over the prompts, by the field that asks for them."""
    max_tokens, echo, k = _max_tokens(request), bool(request.echo), request.logprobs
    parts = dict.fromkeys(("max_tokens", "echo", "logprobs", "prompt_logprobs", "return_token_ids"), 0)
    for prompt in prompts:
        tokens = len(prompt.token_ids)
        parts["max_tokens"] += CHOICE_BYTES + max_tokens * TEXT_BYTES_PER_TOKEN
        if echo:
            parts["echo"] += len(prompt.text)
        if k is not None:
            parts["logprobs"] += ((tokens if echo else 0) + max_tokens) * (LOGPROB_BYTES + k * TOP_LOGPROB_BYTES)
        if request.prompt_logprobs is not None:
            parts["prompt_logprobs"] += tokens * (request.prompt_logprobs + 1) * PROMPT_LOGPROB_BYTES
        if request.return_token_ids:
            parts["return_token_ids"] += (tokens + max_tokens) * TOKEN_ID_BYTES
    return parts


def check_text_length(chars: int, bound: TextBound, max_model_len: int) -> int:
    """The fewest tokens a text prompt of `chars` characters can be; a 400 when even that cannot fit the context
    (whatever truncate_prompt_tokens would cut from it afterwards), so it is not tokenised."""
    tokens = bound.fewest_tokens(chars)
    if tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens, however your prompt of {chars} "
            f"characters is at least {tokens} tokens with this model's vocabulary. Please reduce your prompt.",
            "prompt",
            "context_length_exceeded",
        )
    return tokens


def _too_many_prompt_tokens(total: int, limit: int, at_least: bool = False) -> APIError:
    counted = f"{total} or more" if at_least else str(total)
    return invalid_request(
        f"Too many prompt tokens: {counted} in one request; this server takes at most {limit}.", "prompt"
    )


def _size(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} bytes"
