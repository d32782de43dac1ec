"""A completion's prompts, prepared: text or token ids → the ids the model reads, the text echo returns, and every
check that can refuse them with a 400 before the engine is called (vocabulary, context length, content filter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.api import protocol
from tokenmill.api.engine_protocol import Tokenizer
from tokenmill.api.errors import context_length_exceeded, invalid_request
from tokenmill.api.protocol import CompletionRequest
from tokenmill.engine.content_filter import ContentFilter
from tokenmill.engine.outputs import RequestOutput, TokenLogprob


@dataclass
class Prompt:
    token_ids: list[int]  # what the model reads
    text: str  # what echo returns: the string as sent, or the decoded token ids
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # the prompt tokens' own logprobs, for echo
    hidden: int = 0  # leading tokens the model reads but the client did not send (an added BOS): echo leaves them out
    started_at: float | None = None  # time.monotonic() of its first engine output, first token, last token, end
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    # what its choices write of it once (echo's logprobs, prompt_logprobs), made by the first, shared by the rest
    shared: dict[str, Any] = field(default_factory=dict)

    def saw(self, output: RequestOutput, now: float) -> None:
        """Note when an output arrived: the first one, and those that brought tokens or the end."""
        if self.started_at is None:
            self.started_at = now
        if any(delta.token_ids for delta in output.deltas):
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if output.finished:
            self.finished_at = now

    @property
    def echoed_logprobs(self) -> list[TokenLogprob]:
        return (self.logprobs or [])[self.hidden :]


def prepare_prompts(
    request: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    max_tokens: int,
    bos_before_ids: bool = False,
) -> list[Prompt]:
    """`bos_before_ids` (--add-bos-to-token-prompts): a token-id prompt of a model that starts every text with BOS
    gets one, unseen by the client, when it does not start with it."""
    _check_in_vocabulary([int(key) for key in request.logit_bias or {}], tokenizer.vocab_size, "logit_bias")
    _check_in_vocabulary(request.stop_token_ids or [], tokenizer.vocab_size, "stop_token_ids")
    _check_in_vocabulary(request.allowed_token_ids or [], tokenizer.vocab_size, "allowed_token_ids")
    items = prompt_items(request.prompt)
    if request.suffix:
        prompts = [_infill_prompt(item, request.suffix, tokenizer) for item in items]
    else:
        with_text = bool(request.echo) or request.logprobs is not None  # echo returns it; text_offset counts it
        keep = Truncation(request.truncate_prompt_tokens, request.truncation_side or "left")
        prompts = [_prompt(item, tokenizer, with_text, keep, bos_before_ids) for item in items]
    for prompt in prompts:
        if len(prompt.token_ids) + max_tokens > max_model_len:
            raise context_length_exceeded(max_model_len, len(prompt.token_ids), max_tokens)
    return prompts


def prompt_items(prompt: protocol.PromptInput | None) -> Sequence[str | list[int]]:
    if prompt is None:  # OpenAI: no prompt means "from the start of a document"
        return [""]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return prompt


def _check_in_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"'{param}' token id {bad} is outside the vocabulary [0, {vocab_size})", param)


@dataclass(frozen=True)
class Truncation:
    tokens: int | None  # truncate_prompt_tokens: the most prompt tokens kept; None: all
    side: str  # truncation_side: "left" drops the first tokens, "right" the last


def _prompt(
    item: str | list[int], tokenizer: Tokenizer, with_text: bool, keep: Truncation, bos_before_ids: bool
) -> Prompt:
    """A text prompt gets BOS as the tokenizer adds it. A token-id prompt is read exactly as sent, as OpenAI and vLLM
    read it: whoever tokenised it chose its special tokens. With `bos_before_ids`, a model that starts every text with
    BOS gets one before ids that do not start with it, unseen by the client (echo and its logprobs are the tokens
    sent): lm-evaluation-harness's remote tokenizer sends ids without it, and the model scores text it was never
    trained to see without it.

    `with_text`: a token-id (or truncated) prompt's text is decoded, for echo and text_offset. `keep`
    (truncate_prompt_tokens, truncation_side): only the last (or first) tokens the model would read are kept; echo
    then returns their text."""
    if isinstance(item, str):
        ids, text, hidden = tokenizer.encode(item) or _document_start(tokenizer), item, 0
    else:
        _check_in_vocabulary(item, tokenizer.vocab_size, "prompt")
        bos = tokenizer.bos_id
        wanted = bos_before_ids and bos is not None and item[0] != bos and tokenizer.add_bos
        added = [bos] if wanted and bos is not None else []
        ids, text, hidden = added + list(item), tokenizer.decode(item) if with_text else "", len(added)
    if keep.tokens is not None and len(ids) > keep.tokens:
        if keep.side == "left":  # the end of a prompt is what the model continues from: vLLM's default
            cut = len(ids) - keep.tokens
            ids, hidden = ids[cut:], max(hidden - cut, 0)
        else:
            ids = ids[: keep.tokens]
            hidden = min(hidden, len(ids))
        text = tokenizer.decode(ids[hidden:]) if with_text else ""
    return Prompt(ids, text, hidden=hidden)


def _infill_prompt(item: str | list[int], suffix: str, tokenizer: Tokenizer) -> Prompt:
    """The prompt is the text before the gap, `suffix` the text after it: the model's fill-in-the-middle layout
    (tokenizer/fim.py). echo returns the prompt as sent."""
    if not tokenizer.supports_fim:
        raise invalid_request("'suffix' is not supported: this model has no fill-in-the-middle tokens", "suffix")
    if not isinstance(item, str):
        raise invalid_request("'suffix' needs the prompt as text, not token ids", "suffix")
    return Prompt(tokenizer.encode_infill(item, suffix), item)


def _document_start(tokenizer: Tokenizer) -> list[int]:
    """An empty string prompt on a tokenizer that adds no BOS: start from BOS (or EOS, the document separator)."""
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if start is None:
        raise invalid_request("'prompt' is empty and this model has no BOS/EOS token to start from", "prompt")
    return [start]


def check_content(
    request: CompletionRequest, prompts: list[Prompt], tokenizer: Tokenizer, content_filter: ContentFilter
) -> None:
    """A prompt (as text, token-id prompts decoded) or suffix that the server's content filter matches: a 400."""
    for prompt in prompts:
        text = prompt.text or tokenizer.decode(prompt.token_ids[prompt.hidden :])
        if content_filter.matches(text):
            raise invalid_request(_FILTERED.format("prompt"), "prompt", "content_filter")
    if request.suffix and content_filter.matches(request.suffix):
        raise invalid_request(_FILTERED.format("suffix"), "suffix", "content_filter")


_FILTERED = "The {} contains text that this server's content filter does not allow."


def bad_words_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's tokens as it would appear at the start of the text and after a space (vLLM's rule: a
    tokenizer spells a word differently there), without duplicates."""
    variants: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                variants[ids] = None
    return tuple(variants)
