"""LoRA adapters applied per row: one step's rows may each run the base model or base + one adapter.

Every adaptable linear of the decoder layers is wrapped in a LoraLinear. The base product runs once for all the
step's rows; then, for each adapter that some of the rows use, the low-rank part on those rows only: x·Aᵀ (the shrink,
r columns, every adapted part of a stacked linear's A stacked so that it is one product) and its ·Bᵀ (the expand,
one per part, its scale folded into B), added to the part's columns. A row without an adapter gets the base product
and nothing else, whatever its neighbours use.

Adapters sit in numbered slots (AdapterSlots.install); the engine says which rows use which slot before each step
(`rows`). Where the step's layers run as one C call (model/c_layer.py), kernels/lora.c adds the same updates there
(AdapterSlots.c_step: the step's groups as it takes them); elsewhere the wrapped modules add them here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.linear import chunked_linear
from tokenmill.model.loading.lora_files import AdapterError, AdapterFile, LowRank, layer_and_name, read_adapter
from tokenmill.model.model_config import ModelConfig

__all__ = ["AdapterError", "AdapterSlots", "LoraLinear", "StepRows", "base_state_dict", "read_adapter", "unwrap"]

# a decoder layer's linears as its modules hold them (attention's and MLP's), and the checkpoint's projections that a
# stacked one holds in order (CausalLM.STACKED_PROJECTIONS); an adapter may name either
ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "c_fc", "c_proj")
# the projections the one-call layers update (kernels.h's LORA_PROJECTIONS, in the order of their plan)
C_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
Rows = slice | torch.Tensor  # a step's rows of one adapter: a run of them, or their indices


@dataclass(frozen=True)
class PackedUpdate:
    """One adapter's update of one linear: its parts' A stacked (R, in), and each part's (columns, rows of the
    stacked shrink's output, scale · Bᵀ); in the activations' dtype. In bf16 each Bᵀ is kept only as lora.c reads it,
    in blocks of 16 columns ((ceil(n / 16), rank, 16)), and `c` points into these tensors; else as (rank, n)."""

    a: torch.Tensor
    parts: tuple[tuple[slice, slice, torch.Tensor], ...]
    c: ops.LoraUpdate | None

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: Rows, indices: list[int]) -> None:
        """y[rows] += the update of x[rows] (`indices`: the same rows), as lora.c computes it: float32 sums, rounded to
        y's dtype once. In bf16 lora.c itself does it, so that the modules give the one-call layers' bits."""
        if self.c is not None and _c_takes(x, y):
            ops.lora_update_rows(self.c, indices, x, y)
        else:
            self.add_in_torch(y, x, rows)

    def add_in_torch(self, y: torch.Tensor, x: torch.Tensor, rows: Rows) -> None:
        """add_to in torch: the same float32 sums, in another order."""
        shrunk = _product(x[rows].float(), self.a.float())  # (rows, R)
        for columns, ranks, b in self.parts:
            bt = _unblocked(b, columns.stop - columns.start) if self.c is not None else b
            y[rows, columns] = (y[rows, columns].float() + _product(shrunk[:, ranks], bt.float().t())).to(y.dtype)


def _c_takes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype == y.dtype == torch.bfloat16
        and x.dim() == y.dim() == 2
        and x.stride(1) == y.stride(1) == 1
        and ops.library() is not None
    )


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x·wᵀ in float32, a fixed number of rows per call (batch invariance, as the base linears: linear.py)."""
    return chunked_linear(x, w)


class StepRows:
    """Which of this step's rows use which adapter slot: (slot, rows) per slot in use, rows without one left out."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, Rows, list[int]]] = []  # (slot, its rows, the same rows' indices)

    def set(self, runs: Iterable[tuple[int | None, int]]) -> None:
        """`runs`: each scheduled sequence's (slot or None, its number of rows), in the step's order."""
        spans: dict[int, list[tuple[int, int]]] = {}
        at = 0
        for slot, count in runs:
            if slot is not None and count:
                spans.setdefault(slot, []).append((at, at + count))
            at += count
        self.groups = [
            (slot, _rows(found), [r for lo, hi in found for r in range(lo, hi)]) for slot, found in spans.items()
        ]

    def clear(self) -> None:
        self.groups = []


def _rows(spans: list[tuple[int, int]]) -> Rows:
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    if len(merged) == 1:
        return slice(*merged[0])
    return torch.cat([torch.arange(lo, hi) for lo, hi in merged])


class LoraLinear(nn.Module):
    """A linear plus the low-rank updates of the adapters in its slots, each on the rows that use it."""

    def __init__(self, base: nn.Module, part_widths: Sequence[int], in_features: int, step: StepRows) -> None:
        super().__init__()
        self.base = base
        self.part_widths = tuple(part_widths)  # a stacked linear's parts' output widths, in order
        self.in_features = in_features
        self.out_features = sum(part_widths)
        self.updates: dict[int, PackedUpdate] = {}
        self._step = step  # shared by every LoraLinear of the model; not a submodule

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.base(x, *args, **kwargs)
        for slot, rows, indices in self._step.groups:
            update = self.updates.get(slot)
            if update is not None:
                update.add_to(y, x, rows, indices)
        return y


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() under the names it has without LoraLinear wrappers (`….qkv_proj.base.x` → `….qkv_proj.x`):
    what the prepared weights' cache keeps."""
    wrapped = [name + ".base." for name, module in model.named_modules() if isinstance(module, LoraLinear)]
    renamed = {}
    for key, value in model.state_dict().items():
        prefix = next((p for p in wrapped if key.startswith(p)), None)
        renamed[key if prefix is None else prefix[: -len("base.")] + key[len(prefix) :]] = value
    return renamed


def unwrap(linear: nn.Module) -> nn.Module:
    """The base linear under a LoraLinear, or the linear itself."""
    return linear.base if isinstance(linear, LoraLinear) else linear


class AdapterSlots:
    """A model's adaptable linears wrapped, and the adapters installed in them by slot."""

    def __init__(self, layers: Iterable[nn.Module], cfg: ModelConfig, stacked: dict[str, tuple[str, ...]]) -> None:
        self.cfg = cfg
        self.rows = StepRows()
        # a checkpoint module's path → (the wrapper that holds it, the index of its part; None: the whole linear)
        self.targets: dict[str, tuple[LoraLinear, int | None]] = {}
        self.projections: list[list[LoraLinear | None]] = []  # per layer, in C_PROJECTIONS' order (lora.c's)
        self._tables: dict[int, ctypes.Array[ctypes.c_void_p]] = {}  # slot → its updates for lora.c, by layer
        widths = projection_widths(cfg)
        for i, layer in enumerate(layers):
            for holder_name in ("self_attn", "mlp"):
                holder = getattr(layer, holder_name)
                for name in ADAPTABLE:
                    base = getattr(holder, name, None)
                    if base is None:
                        continue
                    parts = stacked.get(name, (name,))
                    wrapper = LoraLinear(base, [widths[p][1] for p in parts], widths[parts[0]][0], self.rows)
                    setattr(holder, name, wrapper)
                    prefix = f"model.layers.{i}.{holder_name}."
                    self.targets[prefix + name] = (wrapper, None)
                    if len(parts) > 1:
                        self.targets.update({prefix + p: (wrapper, k) for k, p in enumerate(parts)})
            self.projections.append([self.targets.get(f"model.layers.{i}.{p}", (None,))[0] for p in C_PROJECTIONS])

    def check(self, adapter: AdapterFile, model_name: str) -> None:
        """Raises AdapterError where `adapter` names a module this model lacks or shapes that differ from its."""
        for module, update in adapter.modules.items():
            target = self.targets.get(module)
            if target is None:
                where = layer_and_name(module)
                what = "no adaptable linear" if where is None or where[0] < self.cfg.num_layers else "no such layer"
                raise AdapterError(
                    f"adapter {adapter.path} (built for {adapter.built_for}) does not fit {model_name} "
                    f"({self.cfg.architecture}, {self.cfg.num_layers} layers): {module} is {what} there"
                )
            wrapper, part = target
            out = wrapper.out_features if part is None else wrapper.part_widths[part]
            if update.a.shape[1] != wrapper.in_features or update.b.shape[0] != out:
                raise AdapterError(
                    f"adapter {adapter.path} (built for {adapter.built_for}) does not fit {model_name} "
                    f"({self.cfg.architecture}): {module} is {update.a.shape[1]} → {update.b.shape[0]} in the adapter, "
                    f"{wrapper.in_features} → {out} in the model"
                )

    def install(self, slot: int, adapter: AdapterFile, dtype: torch.dtype) -> None:
        """Puts `adapter` (checked) in `slot` of every linear it adapts, in the activations' dtype."""
        by_wrapper: dict[int, tuple[LoraLinear, list[tuple[int | None, LowRank]]]] = {}
        for module, update in adapter.modules.items():
            wrapper, part = self.targets[module]
            by_wrapper.setdefault(id(wrapper), (wrapper, []))[1].append((part, update))
        for wrapper, updates in by_wrapper.values():
            wrapper.updates[slot] = _pack(wrapper, updates, dtype)
        if dtype == torch.bfloat16:
            self._tables[slot] = self._table(slot)

    def remove(self, slot: int) -> None:
        for wrapper, _ in self.targets.values():
            wrapper.updates.pop(slot, None)
        self._tables.pop(slot, None)

    def _table(self, slot: int) -> ctypes.Array[ctypes.c_void_p]:
        """lora.c's table of the adapter in `slot`: its update of each layer's projections (NULL where none)."""
        table = (ctypes.c_void_p * (len(self.projections) * len(C_PROJECTIONS)))()
        for i, wrappers in enumerate(self.projections):
            for j, wrapper in enumerate(wrappers):
                update = wrapper.updates.get(slot) if wrapper is not None else None
                if update is not None and update.c is not None:
                    table[i * len(C_PROJECTIONS) + j] = ctypes.addressof(update.c)
        return table

    def c_step(self) -> ops.LoraStep | None:
        """This step's groups as lora.c takes them (the arrays it points into kept on it); None where an adapter in
        it has no C form (not bf16) or no row has one."""
        groups = self.rows.groups
        if not groups or any(slot not in self._tables for slot, _, _ in groups):
            return None
        ends, rows, total = [], [], 0
        for _, _, indices in groups:
            rows += indices
            total += len(indices)
            ends.append(total)
        arrays = (
            (ctypes.c_int64 * len(ends))(*ends),
            (ctypes.c_int64 * len(rows))(*rows),
            (ctypes.c_void_p * len(ends))(*(ctypes.addressof(self._tables[slot]) for slot, _, _ in groups)),
        )
        step = ops.LoraStep(len(ends), len(self.projections), *(ctypes.addressof(a) for a in arrays))
        step.keep = arrays  # alive as long as the step
        return step

    def wrappers(self) -> list[LoraLinear]:
        return list({id(w): w for w, _ in self.targets.values()}.values())


def _pack(wrapper: LoraLinear, updates: list[tuple[int | None, LowRank]], dtype: torch.dtype) -> PackedUpdate:
    starts = [0]
    for width in wrapper.part_widths:
        starts.append(starts[-1] + width)
    a_blocks, parts, rank_at = [], [], 0
    for part, update in sorted(updates, key=lambda u: -1 if u[0] is None else u[0]):
        columns = slice(0, wrapper.out_features) if part is None else slice(starts[part], starts[part + 1])
        a_blocks.append(update.a)
        ranks = slice(rank_at, rank_at + update.rank)
        rank_at += update.rank
        parts.append((columns, ranks, (update.b * update.scale).t().to(dtype).contiguous()))
    a = torch.cat(a_blocks).to(dtype).contiguous()
    if dtype != torch.bfloat16 or len(parts) > ops.LORA_MAX_PARTS:
        return PackedUpdate(a, tuple(parts), None)
    blocked = tuple((columns, ranks, _column_blocks(bt)) for columns, ranks, bt in parts)
    c = ops.LoraUpdate(a.data_ptr(), a.shape[1], a.shape[0], len(parts))
    for i, (columns, ranks, blocks) in enumerate(blocked):
        c.part[i] = ops.LoraPart(
            blocks.data_ptr(), columns.start, columns.stop - columns.start, ranks.start, blocks.shape[1]
        )
    return PackedUpdate(a, blocked, c)


def _unblocked(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """_column_blocks undone: (rank, n)."""
    return blocks.transpose(0, 1).reshape(blocks.shape[1], -1)[:, :n]


def _column_blocks(bt: torch.Tensor) -> torch.Tensor:
    """(rank, n) → (ceil(n / 16), rank, 16): each block of 16 columns' weights side by side (zeros past n)."""
    rank, n = bt.shape
    padded = torch.nn.functional.pad(bt, (0, -n % 16))
    return padded.view(rank, -1, 16).transpose(0, 1).contiguous()


def projection_widths(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every projection's (input, output) width, by its checkpoint name and by its stacked name."""
    q, kv, hidden, ffn = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "qkv_proj": (hidden, q + 2 * kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, ffn),
        "up_proj": (hidden, ffn),
        "gate_up_proj": (hidden, 2 * ffn),
        "down_proj": (ffn, hidden),
        "c_fc": (hidden, ffn),
        "c_proj": (ffn, hidden),
    }
