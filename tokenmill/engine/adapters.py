"""The engine's LoRA adapters by name: loaded into the model's slots (model/lora.py), chosen per request.

A request names an adapter (SamplingParams.adapter); the core takes its slot when the request arrives, and each step
tells the model which rows use which slot. Unloading takes the name away at once (new requests are refused) and the
slot's weights once no sequence still uses them, so a request never changes adapter in the middle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.lora import AdapterError, AdapterSlots, read_adapter


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    slot: int
    path: str
    digest: str  # SHA-256 of its weights: the prefix cache's chains of its requests start from it
    rank: int


class AdapterRegistry:
    """Adapters loaded under names, at most `max_loras` at once and none of rank above `max_rank` (vLLM's flags)."""

    def __init__(self, model: CausalLM, model_name: str, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.model_name = model_name
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.slots: AdapterSlots = model.enable_adapters()
        self.dtype = next(model.parameters()).dtype
        self._by_name: dict[str, LoadedAdapter] = {}
        self._retiring: set[int] = set()  # slots whose adapter was unloaded while sequences still used it

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Reads, checks and installs the adapter at `path` under `name` (AdapterError: why not)."""
        if name in self._by_name:
            raise AdapterError(f"an adapter named {name!r} is already loaded (unload it first)")
        if len(self._by_name) >= self.max_loras:
            raise AdapterError(f"{len(self._by_name)} adapters are loaded, the most --max-loras allows")
        adapter = read_adapter(path, self.model.config)
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {path} has rank {adapter.rank}, above --max-lora-rank {self.max_rank}")
        if not adapter.modules:
            raise AdapterError(f"adapter {path} adapts no linear")
        self.slots.check(adapter, self.model_name)
        taken = {a.slot for a in self._by_name.values()} | self._retiring
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        self.slots.install(slot, adapter, self.dtype)
        loaded = LoadedAdapter(name, slot, adapter.path, adapter.digest, adapter.rank)
        self._by_name[name] = loaded
        return loaded

    def unload(self, name: str, in_use: Iterable[int]) -> None:
        """Takes `name` away; its weights go now, or once none of the slots `in_use` is its."""
        loaded = self._by_name.pop(name, None)
        if loaded is None:
            raise KeyError(name)
        self._retiring.add(loaded.slot)
        self.release_unused(in_use)

    def release_unused(self, in_use: Iterable[int]) -> None:
        """Drops the weights of unloaded adapters that no sequence uses any more."""
        if not self._retiring:
            return
        free = self._retiring - set(in_use)
        for slot in free:
            self.slots.remove(slot)
        self._retiring -= free

    @property
    def retiring(self) -> bool:
        return bool(self._retiring)

    def get(self, name: str) -> LoadedAdapter | None:
        return self._by_name.get(name)

    def loaded(self) -> list[LoadedAdapter]:
        return list(self._by_name.values())
