"""The wire format: pydantic request models in the OpenAI reference's field order, and the response shapes.

`None` means "not sent"; `CompletionRequest.to_sampling_params` resolves it to OpenAI's default. Every field we cannot
honour is rejected with a 400 naming it (unknown fields included), never silently ignored. Cross-field checks raise
`APIError` naming the offending `param`; pydantic does not wrap that exception, so it reaches the app unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from tokenmill.api.errors import APIError, invalid_request
from tokenmill.engine.guided import Guide, json_schema_guide
from tokenmill.engine.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # longer stop strings make the hold-back search slow and cannot be useful
MAX_LOGIT_BIAS_ENTRIES = 1024
TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]+\s*")  # what int() reads as one integer ("--5" is not one: a 400, not a 500)
MAX_TOKEN_ID_DIGITS = 12  # a logit_bias key longer than this is no token id (and would be slow to convert)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# past these a seen token has no chance, or nothing else has: nothing a client could mean, and logits would overflow
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TOKEN_LIST = 1024  # stop_token_ids, bad_words
MAX_ALLOWED_TOKENS = 1 << 20  # allowed_token_ids: any subset of a vocabulary
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_GRAMMAR_CHARS = 1 << 16
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]

PromptInput = str | list[str] | list[int] | list[list[int]]
_PROMPT_SHAPE = "'prompt' must be a string, an array of strings, an array of tokens, or an array of token arrays"


def _ext(description: str) -> Any:
    """A field beyond the reference: not sent means off, and the OpenAPI document says what it does."""
    return Field(default=None, description=description)


class _Strict(BaseModel):
    # strict: no "2" → 2 or 1 → True coercions; JSON ints are still accepted for float fields.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


MAX_LORA_CHOICES = 64


class LoraChoice(_Strict):
    """One entry of llama-server's per-request `lora` list."""

    id: Annotated[int, Field(ge=0)]
    scale: Annotated[float, Field(ge=-100.0, le=100.0)]


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | bool | None = Field(default=None, alias="json")  # a JSON Schema (true: any JSON value)
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_TOKEN_LIST)] | None
    ) = None
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None  # Lark or GBNF

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        given = [name for name, value in values.items() if value is not None]
        if len(given) != 1:
            raise invalid_request(
                f"'structured_outputs' takes exactly one of json, regex, choice, grammar; got {given or 'none'}",
                "structured_outputs",
            )
        return self

    def to_guide(self) -> Guide:
        if self.json_ is not None:
            return json_schema_guide(self.json_ if isinstance(self.json_, dict) else {})
        if self.regex is not None:
            return Guide("regex", self.regex)
        if self.choice is not None:
            return Guide("regex", "|".join(re.escape(c) for c in self.choice))
        assert self.grammar is not None
        return Guide("grammar", self.grammar)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format` as vLLM and SGLang take it on completions."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid_request(
                "'response_format' needs 'json_schema' exactly when its type is 'json_schema'", "response_format"
            )
        return self

    def to_guide(self) -> Guide | None:
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else {"type": "object"}
        return json_schema_guide(schema)


class CompletionRequest(_Strict):
    model: str
    prompt: PromptInput | None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    echo: bool | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    user: str | None = None
    # --- beyond the reference: vLLM's names for the knobs the best servers add (clients send them in extra_body) ---
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = _ext(
        "sample among the k most likely tokens; 0 or -1: off"
    )
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = _ext(
        "drop tokens less likely than min_p times the most likely token's probability; 0: off"
    )
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = _ext(
        "every token of the prompt and output so far: a positive logit divided by it, a negative one multiplied; 1: off"
    )
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = _ext(
        "before this many tokens, EOS and stop_token_ids cannot be sampled; stop strings are looked for from the"
        " min_tokens-th token's text on"
    )
    ignore_eos: bool | None = _ext("the model's end-of-sequence token does not end the completion")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_LIST)] | None = _ext(
        "token ids that end the completion (finish_reason stop, stop_reason the id)"
    )
    include_stop_str_in_output: bool | None = _ext("a matched stop string stays at the end of the text")
    skip_special_tokens: bool | None = _ext("leave special tokens out of the text (default true)")
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKENS)] | None = _ext(
        "only these token ids may be generated"
    )
    bad_words: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_TOKEN_LIST)
        ]
        | None
    ) = _ext("words never to generate (as the text's first word or after a space)")
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = _ext(
        "keep only the prompt's last k tokens"
    )
    return_token_ids: bool | None = _ext("each choice also carries prompt_token_ids and token_ids")
    structured_outputs: StructuredOutputs | None = _ext(
        "the text must follow exactly one of: a JSON Schema (json), a regex (regex), one of a list of strings"
        " (choice), a Lark or GBNF grammar (grammar)"
    )
    response_format: ResponseFormat | None = _ext(
        "json_object: the text is a JSON object; json_schema: it follows json_schema.schema; text: no constraint"
    )
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_PROMPT_LOGPROBS)] | None = _ext(
        "each choice also carries prompt_logprobs: per prompt token (null for the first), its logprob, rank and text"
        " and those of the k likeliest tokens, keyed by token id"
    )

    return_tokens_as_token_ids: bool | None = _ext(
        "logprobs name every token and alternative 'token_id:N' rather than by its text (text_offset still indexes"
        " the text)"
    )
    use_beam_search: bool | None = _ext(
        "beam search: the n likeliest continuations (max(n, best_of) beams kept each step), ranked by cumulative"
        " logprob / length ** length_penalty; deterministic"
    )
    length_penalty: Annotated[float, Field(ge=-10.0, le=10.0)] | None = _ext(
        "with use_beam_search: the exponent of the length that divides a beam's cumulative logprob (default 1)"
    )
    truncation_side: Literal["left", "right"] | None = _ext(
        "with truncate_prompt_tokens: left (the default) drops the prompt's first tokens, right its last ones"
    )
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)] | None = _ext(
        "cached prompt blocks are shared only among requests that send the same salt"
    )
    lora: Annotated[list[LoraChoice], Field(max_length=MAX_LORA_CHOICES)] | None = _ext(
        "llama-server's choice of LoRA adapters: {id, scale} per adapter, id its place among the adapters served (as"
        " /v1/models lists them); one adapter at scale 1 runs, the others at scale 0 do not (a mix or another scale"
        " is refused)"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise PydanticCustomError("prompt", _PROMPT_SHAPE + " (an empty array is not a prompt)")
        if all(isinstance(x, str) for x in value) or all(_is_token_id(x) for x in value):
            return value
        if all(isinstance(x, list) for x in value):
            if not all(value):
                raise PydanticCustomError("prompt", "'prompt' contains an empty token array")
            if all(_is_token_id(t) for x in value for t in x):
                return value
        raise PydanticCustomError("prompt", _PROMPT_SHAPE)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):
            if not 1 <= len(items) <= MAX_STOP_SEQUENCES:
                raise PydanticCustomError("stop", "'stop' must be a string or an array of 1 to 4 strings")
            if any(item == "" for item in items):
                raise PydanticCustomError("stop", "'stop' sequences must not be empty strings")
            if any(isinstance(item, str) and len(item) > MAX_STOP_CHARS for item in items):
                raise PydanticCustomError("stop", f"'stop' sequences must be at most {MAX_STOP_CHARS} characters long")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise PydanticCustomError(
                "logit_bias", f"'logit_bias' may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}"
            )
        for key in value or {}:
            if len(key) > MAX_TOKEN_ID_DIGITS or not TOKEN_ID_KEY.fullmatch(key):
                raise PydanticCustomError(
                    "logit_bias",
                    "'logit_bias' keys must be token ids (integers as strings), got {key}",
                    {"key": json.dumps(key[: MAX_TOKEN_ID_DIGITS + 1])},
                )
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> CompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise invalid_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if self.best_of is not None and self.best_of < self.num_choices:
            raise invalid_request(f"'best_of' ({self.best_of}) must be at least 'n' ({self.num_choices})", "best_of")
        if self.stream and self.best_of is not None and self.best_of > 1:
            raise invalid_request("'best_of' greater than 1 cannot be streamed", "best_of")
        max_tokens = self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise invalid_request(
                f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({max_tokens})", "min_tokens"
            )
        if self.structured_outputs is not None and self.response_format is not None:
            raise invalid_request(
                "'structured_outputs' and 'response_format' both constrain the text: send one", "response_format"
            )
        if self.use_beam_search:
            self._check_beam_search()
        elif self.length_penalty is not None:
            raise invalid_request("'length_penalty' needs 'use_beam_search'", "length_penalty")
        if self.truncate_prompt_tokens is not None and self.suffix is not None:
            raise invalid_request(
                "'truncate_prompt_tokens' cannot cut a fill-in-the-middle prompt ('suffix')", "truncate_prompt_tokens"
            )
        return self

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the model's own log-probabilities and keeps the likeliest: a field that would
        sample, reshape or constrain the distribution has no meaning in it, and is refused rather than ignored."""
        sampling = {
            "temperature": self.temperature not in (None, 0.0),  # the search is greedy by construction
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "min_tokens": bool(self.min_tokens),
            "structured_outputs": self.structured_outputs is not None,
            "response_format": self.response_format is not None and self.response_format.type != "text",
        }
        refused = next((name for name, sent in sampling.items() if sent), None)
        if refused is not None:
            raise invalid_request(f"'{refused}' cannot be used with 'use_beam_search'", refused)

    @property
    def beam_search(self) -> tuple[int, float] | None:
        """(beams kept each step, length penalty) with use_beam_search; None without."""
        if not self.use_beam_search:
            return None
        return self.num_candidates, self.length_penalty if self.length_penalty is not None else 1.0

    # --- resolved values: user value → OpenAI default -----------------------------------------------------------
    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: best_of when it is larger than n."""
        return max(self.num_choices, self.best_of or 1)

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def guide(self) -> Guide | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.to_guide()
        return self.response_format.to_guide() if self.response_format is not None else None

    @property
    def prompt_top_k(self) -> int | None:
        """Alternatives to compute per prompt token: for echo's logprobs and for prompt_logprobs; None: none wanted."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats, which (as there) counts only together with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def include_obfuscation(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_obfuscation)

    def to_sampling_params(self) -> SamplingParams:
        def pick(value: float | None, default: float) -> float:
            return float(value) if value is not None else default

        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS,
            temperature=pick(self.temperature, DEFAULT_TEMPERATURE),
            top_p=pick(self.top_p, DEFAULT_TOP_P),
            top_k=max(self.top_k or 0, 0),
            min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            seed=self.seed,
            stop=self.stop_sequences,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            guide=self.guide,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_top_k,
            n=self.num_candidates,
            cache_salt=self.cache_salt,
        )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | list[int]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter (`lora_int_id`, its other way to name one, is accepted and not needed)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None


# --- parsing: pydantic errors → one APIError naming the field ------------------------------------------------------
M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise api_error_from_validation(exc.errors()) from None


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that parses `model` itself with parse_request (so that bad values stay
    400s naming the param, never FastAPI's 422): the model's JSON schema, nested models inlined."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(definitions[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def api_error_from_validation(errors: Sequence[ErrorDetails | dict[str, Any]], loc_prefix: int = 0) -> APIError:
    """The first pydantic error as a 400; `loc_prefix` drops FastAPI's leading ("body",)."""
    first = errors[0] if errors else {"type": "invalid", "loc": (), "msg": "Invalid request"}
    kind = str(first.get("type", ""))
    loc = [str(part) for part in tuple(first.get("loc", ()))[loc_prefix:]]
    if kind == "json_invalid":  # the parser's reason: syntax, nesting too deep, bad UTF-8, number out of range
        reason = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        return invalid_request(f"We could not parse the JSON body of your request: it is not valid JSON ({reason}).")
    if not loc:
        return invalid_request("The request body must be a JSON object.")
    if kind == "extra_forbidden":
        name = ".".join(loc)
        return invalid_request(f"Unrecognized request argument supplied: {name}", name)
    if kind == "missing":
        name = ".".join(loc)
        return invalid_request(f"Missing required parameter: '{name}'.", name)
    param = loc[0]
    message = f"Invalid value for '{param}': {first.get('msg', 'invalid value')}"
    return invalid_request(message + _quoted(first.get("input", _NOTHING)), param)


_NOTHING = object()
MAX_QUOTED_CHARS = 80  # a bad value is quoted up to this, so that a huge one cannot make a huge error


def _quoted(value: Any) -> str:
    """The bad value as JSON, as vLLM's messages quote it: scalars only (a list or object is named, not copied)."""
    if value is _NOTHING or isinstance(value, (dict, list)):
        return ""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return ""
    return f" (got {text if len(text) <= MAX_QUOTED_CHARS else text[: MAX_QUOTED_CHARS - 1] + '…'})"


# --- responses: every wire shape is built here ---------------------------------------------------------------------
@dataclass(frozen=True)
class CompletionMeta:
    """The fields every response and every stream chunk of one completion share."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    def envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


def choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
    extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's choice, plus vLLM's `stop_reason` (the stop string or token id that ended it; null otherwise) and the
    `extras` asked for (`prompt_token_ids` and `token_ids`, `prompt_logprobs`)."""
    body = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**body, "stop_reason": stop_reason, **(extras or {})}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(meta: CompletionMeta, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
    return {**meta.envelope(), "choices": choices, "usage": use}


def completion_chunk(
    meta: CompletionMeta, choices: list[dict[str, Any]], use: dict[str, Any] | None, with_usage: bool
) -> dict[str, Any]:
    """A stream chunk; with `include_usage` every chunk has a `usage` key (null but on the final one)."""
    chunk = {**meta.envelope(), "choices": choices}
    if with_usage:
        chunk["usage"] = use
    return chunk


def model_card(
    model_id: str, created: int, max_model_len: int, supports_suffix: bool, root: str, parent: str | None = None
) -> dict[str, Any]:
    """OpenAI's model object, plus vLLM's `root` (what it was loaded from: a path, or the package that carries it),
    `parent` (a LoRA adapter's model; null: not an adapter), max_model_len, and whether `suffix` (fill-in-the-middle)
    works."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "tokenmill",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "supports_suffix": supports_suffix,
    }


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
