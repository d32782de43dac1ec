"""SamplingParams: everything the engine needs to know about how one request samples and stops.

The API layer resolves user value → server default → OpenAI default before building this; the engine never sees
`None` meaning "not sent".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.content_filter import ContentFilter
    from tokenmill.engine.guided import Guide


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one's probability; 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's (and vLLM's): over every token of the prompt and the output so far, a positive logit is divided
    # by it and a negative one multiplied; 1: off
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None: every token
    # Token sequences never to complete: a one-token word is banned outright, a longer one's last token is banned
    # whenever the output so far ends with the rest of it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Tokens that end the sequence besides the model's EOS (asked for, or a filled-in middle's end tokens),
    # finish_reason "stop".
    stop_token_ids: tuple[int, ...] = ()
    # before this many output tokens EOS and stop_token_ids are banned, and stop strings are looked for only in the
    # text from the min_tokens-th token on
    min_tokens: int = 0
    ignore_eos: bool = False  # the model's EOS does not end the sequence (stop_token_ids still do)
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    skip_special_tokens: bool = True  # special tokens (BOS, EOS, ...) are left out of the text
    guide: Guide | None = None  # structured outputs: the grammar the text must follow (engine/guided.py)
    content_filter: ContentFilter | None = None  # text the output must not show (engine/content_filter.py)
    content_filter_context: str = ""  # text before the output in the choice (an echoed prompt): a match may begin in it
    # Top-k alternatives to report for each generated token; None: no logprobs wanted (the chosen token's logprob is
    # still tracked, it ranks best_of candidates).
    logprobs: int | None = None
    # Top-k alternatives for each prompt token (echo + logprobs); None: prompt logprobs are not computed at all.
    prompt_logprobs: int | None = None
    # Number of sequences forked from the one prefilled prompt (n, or best_of when it is larger).
    n: int = 1
    # Starts the prefix cache's hash chain: only requests with the same salt share cached KV blocks (vLLM's).
    cache_salt: str | None = None
    # The LoRA adapter (by the name it was loaded under) the model runs with for this request; None: the base model.
    # Its weights' digest joins the salt at the start of the prefix cache's chain: KV made under one adapter is never
    # another's.
    adapter: str | None = None
    # Sequences with the same key share one fair turn in the scheduler (the edge gives each HTTP request its own, so
    # all its prompts and choices are one); None: this engine request alone.
    fairness_key: str | None = None
    # Whose earlier requests a speculative draft may come from (the shared suffix store: engine/suffix_store.py): the
    # hash of the API key the request came with; every request of a server without keys is "anonymous".
    tenant: str = "anonymous"
    # What the sampler derives from these fields once for every sequence that samples with them (allowed_token_ids
    # as a vocabulary mask): not a setting, and a replace() starts it empty.
    derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def greedy(self) -> bool:
        # below this, dividing the logits by the temperature overflows to inf and the softmax to NaN, while the draw
        # it would make is the argmax anyway (vLLM's threshold too)
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
