"""What the HTTP edge needs of an engine and of its tokenizer: the Engine and Tokenizer protocols.

Every engine the app is built around implements all of Engine: AsyncEngine (engine/engine.py), cluster/'s
RemoteEngine, the tests' FakeEngine. A member an engine has no use for still answers, with a no-op or None, so the app
calls each one as it is and never asks whether an engine has it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from tokenmill.engine.outputs import AdapterInfo, EngineDescription, RequestOutput, StepReport
from tokenmill.engine.sampling import SamplingParams


class Tokenizer(Protocol):
    """Text ⇄ token ids, and the special tokens /tokenizer_info reports (tokenmill.tokenizer.Tokenizer)."""

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def pad_token(self) -> str | None: ...

    @property
    def add_bos(self) -> bool: ...  # encode() starts every text with BOS

    @property
    def eos_ids(self) -> tuple[int, ...]: ...  # every id that ends generation (the engine's own set)

    @property
    def vocab_size(self) -> int: ...

    @property
    def supports_fim(self) -> bool: ...

    @property
    def fim_end_ids(self) -> tuple[int, ...]: ...

    @property
    def chat_template(self) -> str | None: ...  # None: none is kept (a completions server applies none)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_infill(self, prefix: str, suffix: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...


class Counters(Protocol):
    """An engine's counters (the real engine's EngineStats): a dataclass, whose fields /stats returns and whose
    queue and KV-cache fields /metrics reads."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


class Engine(Protocol):
    """What the HTTP edge needs of an engine (tokenmill.engine.engine.AsyncEngine, cluster's RemoteEngine)."""

    max_model_len: int
    model_name: str
    system_fingerprint: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def description(self) -> EngineDescription | None: ...  # for the start-up banner; None: it says no more

    async def start(self) -> None: ...  # the app's lifespan starts an engine that is not running yet

    async def stop(self) -> None: ...

    def is_healthy(self) -> bool: ...

    def health(self) -> Mapping[str, int] | None: ...  # replicas running and wanted (cluster/); None: one process

    async def refresh(self) -> None: ...  # state held elsewhere (replicas) fetched before a route reports it

    def stats(self) -> Counters | None: ...  # None: it keeps no counters (/stats is then a 404)

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None: ...  # told of every step it runs

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    def adapters(self) -> Sequence[AdapterInfo]: ...  # the LoRA adapters it serves, by name; [] where none

    async def load_adapter(self, name: str, path: str) -> None: ...  # AdapterLoadError: why it cannot

    async def unload_adapter(self, name: str) -> None: ...  # KeyError: no adapter has that name
