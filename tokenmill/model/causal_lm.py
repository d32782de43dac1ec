"""What every decoder-only architecture shares: the layer loop, the LM head, and a one-sequence dense forward.

An architecture supplies its decoder layer, the rotary embedding each layer uses (`layer_ropes`; SingleRopeCausalLM's
where every layer uses one) and, where it has one, a change to the embeddings (`embed`: Gemma's scale). Parameter
names follow Hugging Face (`model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`) so checkpoints load as
they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.c_layer import CLayer, LayerStack
from tokenmill.model.gguf_linear import GgufLinear
from tokenmill.model.layers import RMSNorm, Rotary
from tokenmill.model.linear import TiledInt8Linear, chunked_linear, float32_product
from tokenmill.model.lora import AdapterSlots
from tokenmill.model.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each (num_slots, Hkv, D)
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin), each (T, 1, D): what Rotary returns


class DecoderModel(nn.Module):
    """The stack under `model.`: token embedding, decoder layers, final norm (built in that order: seeded random
    initialisation in the tests depends on it)."""

    def __init__(
        self, cfg: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module], norm_offset: float
    ) -> None:
        super().__init__()
        # an nn.Embedding, or an Int8Embedding reading the rows of a quantised tied head (linear.prepare_linears)
        self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=norm_offset)


@dataclass(frozen=True)
class HeadSummary:
    """What the LM head's own pass found in each row of raw logits (compute_logits_summarised)."""

    argmax: list[int]  # the first index of the row's largest value (meaningless where the row is not finite)
    finite: list[bool]

    def picked(self, rows: Iterable[int]) -> HeadSummary:
        """What it found in these of its rows, in this order (repeats allowed)."""
        rows = list(rows)
        return HeadSummary([self.argmax[r] for r in rows], [self.finite[r] for r in rows])


@dataclass(frozen=True)
class KernelReport:
    """The C kernels (kernels/) a model's forward calls on activations of one dtype: what the start-up banner lists."""

    modules: tuple[str, ...]  # what its modules call: norms and rotary, attention, the MLP's activation, the matmul
    decoder_layer: bool  # every layer runs as one C call (decoder_layer.c), which calls those same kernels itself


class CausalLM(nn.Module):
    """A subclass builds `model` (its DecoderModel) and `lm_head` (None: tied to the embedding, until a quantised copy
    replaces it), and says which rotary each layer uses."""

    # checkpoint projections that the model holds stacked (one matmul each), in stacking order
    STACKED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {}
    # the C kernel of its gated MLP's activation (layers.gelu_mul, layers.silu_mul); None: torch computes it
    ACTIVATION_KERNEL: ClassVar[str | None] = None
    model: DecoderModel
    lm_head: nn.Module | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layer_stack = LayerStack()  # every layer in one C call where they all run in C
        self.adapters: AdapterSlots | None = None  # LoRA adapters' slots, once enable_adapters has wrapped the linears

    def enable_adapters(self) -> AdapterSlots:
        """Wraps the decoder layers' linears so that LoRA adapters can be installed and chosen per row (model/lora.py);
        call once the linears are prepared. A step whose rows use no adapter runs as before (the C layers too)."""
        if self.adapters is None:
            self.adapters = AdapterSlots(self.model.layers, self.config, type(self).STACKED_PROJECTIONS)
            for layer in self.model.layers:
                if isinstance(layer, CLayer):
                    layer.lora_rows = self.adapters.rows
        return self.adapters

    def _adapted_step(self) -> bool:
        """Some of this step's rows use an adapter."""
        return self.adapters is not None and bool(self.adapters.rows.groups)

    def _step_lora(self) -> tuple[bool, ops.LoraStep | None]:
        """(whether the step's layers can run as one C call, the adapters' updates it then takes): a step with
        adapter rows runs in C only where every adapter in it has its C form (lora.c), else in the modules."""
        if not self._adapted_step():
            return True, None
        assert self.adapters is not None
        lora = self.adapters.c_step()
        return lora is not None, lora

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (T,) → (T, H), the residual stream's start."""
        return self.model.embed_tokens(input_ids)

    def embed_scale(self) -> float | None:
        """What the embedding's rows are multiplied by, in the activations' dtype (Gemma's sqrt(hidden)); None: nothing."""
        return None

    def layer_rotaries(self) -> list[Rotary]:
        """Each layer's rotary module (the layers of one kind share one)."""
        raise NotImplementedError

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """One rotary (cos, sin) per layer, each computed once per forward and shared by the layers that use it."""
        computed: dict[int, Rope] = {}
        ropes = []
        for rotary in self.layer_rotaries():
            rope = computed.get(id(rotary))
            if rope is None:
                rope = computed[id(rotary)] = rotary(positions, dtype)
            ropes.append(rope)
        return ropes

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (T,) → final hidden states (T, hidden)."""
        in_c, lora = self._step_lora()
        if in_c:
            found = self.layer_stack.forward_ids(
                self, input_ids.tolist(), positions.tolist(), kv_caches, meta, lora=lora
            )
            if found is not None:
                return found[0]
        return self._forward_modules(input_ids, positions, kv_caches, meta)

    def forward_step(
        self,
        input_ids: list[int],
        positions: list[int],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep: list[int] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, HeadSummary | None] | None]:
        """forward from plain lists, and where `keep` is given the last row's logits as compute_logits_summarised(last
        row, keep) gives them, if its head ran in the same C call as the layers (a Q8_0 head's 6-bit copy: no Python
        between the two passes over the weights); else None second (the caller takes the head).

        For an engine step: the one-call step takes the lists as they are, writes into buffers it keeps (both results
        are overwritten by the next call) and runs outside torch's inference mode (its outputs are buffers no graph
        records); the other paths enter that mode themselves. After a step has streamed the weights through the
        caches, each torch call, even entering a mode, finds its code cold."""
        in_c, lora = self._step_lora()
        if not in_c:
            with torch.inference_mode():
                return self._forward_modules(torch.tensor(input_ids), torch.tensor(positions), kv_caches, meta), None
        copy = self._greedy_copy() if keep is not None else None
        if copy is not None and keep is not None:
            found = self.layer_stack.forward_ids(self, input_ids, positions, kv_caches, meta, (*copy, keep), True, lora)
            if found is not None:
                hidden, answer = found
                if answer is None:  # the copy could not answer: the full pass, as greedy_row's caller takes it
                    self._head_copy_missed()
                    with torch.inference_mode():
                        return hidden, self.compute_logits_summarised(hidden[-1:])
                logits, argmax = answer
                return hidden, (logits, HeadSummary([argmax], [True]))
        stacked = self.layer_stack.forward_ids(self, input_ids, positions, kv_caches, meta, reuse=True, lora=lora)
        if stacked is not None:
            return stacked[0], None
        with torch.inference_mode():
            return self._forward_modules(torch.tensor(input_ids), torch.tensor(positions), kv_caches, meta), None

    def _forward_modules(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)  # (T, H)
        ropes = self.layer_ropes(positions, x.dtype)
        stacked = (
            None if self._adapted_step() else self.layer_stack.forward(self.model.layers, x, ropes, kv_caches, meta)
        )
        if stacked is not None:
            return self.model.norm(stacked)
        for layer, rope, kv_cache in zip(self.model.layers, ropes, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.model.norm(x)

    def _greedy_copy(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The head's 6-bit copy and regrouped rows (GgufLinear.greedy_parts), where a lone greedy row's head can
        run in the layers' call; else None."""
        head = self.lm_head
        if not isinstance(head, GgufLinear) or self.config.final_logit_softcapping:
            return None
        return head.greedy_parts()

    def _head_copy_missed(self) -> None:
        assert isinstance(self.lm_head, GgufLinear)
        self.lm_head.greedy_missed()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, H) → float32 logits (N, V) (Gemma 2's soft-capped: cap * tanh(logits / cap))."""
        if self.lm_head is not None:
            logits = float32_product(self.lm_head, hidden)
        else:
            tied = cast(torch.Tensor, self.model.embed_tokens.weight)  # no head of its own: the table's nn.Embedding
            # fp32 rows chunked as RowTiledLinear does them (batch invariance); bf16's oneDNN product needs no chunks
            logits = chunked_linear(hidden, tied) if tied.dtype == torch.float32 else F.linear(hidden, tied).float()
        cap = self.config.final_logit_softcapping
        return logits if not cap else logits.div_(cap).tanh_().mul_(cap)

    def compute_logits_summarised(
        self, hidden: torch.Tensor, keep: list[int] | None = None
    ) -> tuple[torch.Tensor, HeadSummary | None]:
        """compute_logits, and where the head is a GGUF kernel's one call with nothing after it (no soft cap), each
        row's argmax and finiteness from the head's own pass (GgufLinear.logits): the sampler need not read the
        logits again for them. `keep`: the one row is greedy and needs only its argmax and these ids' logits, which
        a Q8_0 head with its 6-bit copy gives exactly without reading all of itself (GgufLinear.greedy_row); the
        other logits are then -inf."""
        if isinstance(self.lm_head, GgufLinear) and not self.config.final_logit_softcapping:
            pruned = self.lm_head.greedy_row(hidden, keep) if keep is not None else None
            if pruned is not None:
                return pruned[0], HeadSummary([pruned[1]], [True])
            found = self.lm_head.logits(hidden)
            if found is not None:
                logits, argmax, finite = found
                return logits, HeadSummary(argmax, finite)
        return self.compute_logits(hidden), None

    def weight_bytes_per_token(self) -> int:
        """The bytes of weights one decode step reads: every parameter and buffer once (a tensor that two modules
        share, such as a tied head, counts once), but not an embedding table that a separate head leaves to row
        lookups. On a memory-bound CPU this sets single-stream speed."""
        skip_table = self.lm_head is not None
        sizes: dict[int, int] = {}
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if skip_table and name.startswith("model.embed_tokens."):
                continue
            sizes[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return sum(sizes.values())

    def c_kernels(self, dtype: torch.dtype) -> KernelReport:
        """The C kernels this model's forward calls on activations of `dtype`, by the checks its modules make (its
        linears as prepared: ask once they are swapped, linear.prepare_linears)."""
        in_c = dtype == torch.bfloat16 and ops.library() is not None  # the kernels take bf16 activations only
        head_dim, activation = self.config.head_dim, self.ACTIVATION_KERNEL
        modules = list(self.modules())
        gguf = any(isinstance(m, GgufLinear) and m.kernel for m in modules)
        used = {
            "fused": in_c,  # the norms, norm + residual, q/k norm + rotary
            "paged_attention": in_c
            and head_dim % 16 == 0
            and head_dim <= ops.MAX_ATTENTION_HEAD_DIM
            and ops.paged_attention_available(),
            "gelu_mul": in_c and activation == "gelu_mul" and ops.gelu_mul_available(),
            "silu_mul": in_c and activation == "silu_mul" and ops.silu_mul_available(),
            "int8_matmul": any(isinstance(m, TiledInt8Linear) for m in modules),
            "gguf_matmul": gguf,
            "gguf_amx": gguf and ops.gguf_amx(),  # its batches of 16 rows on AMX tiles
        }
        return KernelReport(tuple(name for name, on in used.items() if on), self.layers_in_c(dtype))

    def layers_in_c(self, dtype: torch.dtype) -> bool:
        """Whether every decoder layer runs as one C call (decoder_layer.c), by the check each layer's forward makes."""
        layers = list(self.model.layers)
        return bool(layers) and all(
            isinstance(layer, CLayer) and layer.c_plan_for(dtype) is not None for layer in layers
        )

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of one sequence, with a throwaway cache (tests and scoring checks)."""
        t = input_ids.shape[0]
        caches = empty_kv_caches(self.config, t, self.model.norm.weight.dtype)
        hidden = self.forward(input_ids, torch.arange(t), caches, dense_metadata(t))
        return self.compute_logits(hidden)


class SingleRopeModel(DecoderModel):
    """A DecoderModel whose layers all rotate by one base, `rope`, as the config gives it (the Llama family,
    StarCoder2)."""

    def __init__(
        self, cfg: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module], norm_offset: float
    ) -> None:
        super().__init__(cfg, make_layer, norm_offset)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope)


class SingleRopeCausalLM(CausalLM):
    """A CausalLM over a SingleRopeModel: every layer gets the one rotary, computed once per forward."""

    model: SingleRopeModel

    def layer_rotaries(self) -> list[Rotary]:
        return [self.model.rope] * len(self.model.layers)


def empty_kv_caches(cfg: ModelConfig, num_slots: int, dtype: torch.dtype) -> list[KVCache]:
    shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


def dense_metadata(num_tokens: int) -> AttentionMetadata:
    """One sequence whose whole prompt is the query, its KV in slots 0..T-1."""
    slots = torch.arange(num_tokens)
    return AttentionMetadata(
        new_slots=slots.tolist(), query_lens=[num_tokens], context_lens=[num_tokens], slots=slots, starts=[0]
    )
