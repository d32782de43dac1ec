"""A decoder layer as one C call (kernels/decoder_layer.c): the plan a layer hands it, built once, and when it can.

On the bf16 + GGUF path a decode step runs a dozen small kernels per layer, and around each Python's module calls,
views and allocations cost more than a small kernel itself. A layer class that mixes in CLayer builds its plan on
first use (what does not change between steps: shapes, norm factors, each projection's GGUF parts) and then runs in
one call, the same kernels in the same order as its modules call them, so the same bits.

LayerStack goes further: every layer of a step in one call, and where the embedding is a GGUF table the whole step
from its token ids to the final norm (StepPlan, ops.decoder_forward). After a step has streamed the weights through
the caches, each torch call Python makes finds its code and data cold, so the fewer the better.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, ClassVar

import torch

from tokenmill.kernels import ops
from tokenmill.model.attention import AttentionMetadata, key_list_bounds
from tokenmill.model.gguf_linear import GgufEmbedding, GgufLinear
from tokenmill.model.lora import StepRows, unwrap

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the plan's fields, in the order layers pass their linears


class CLayer:
    """Mixed into a decoder layer: `c_plan_for(dtype)` is its plan where the C layer can run it, else None."""

    # the tests turn it off to compare the two paths
    c_layer: ClassVar[bool] = True
    c_kernel: ClassVar[str]  # decoder_layer.c's function for this layer: gemma3_layer or llama_layer
    self_attn: Any  # the layer's attention module (its window)
    _plan: ops.DecoderLayerPlan | None = None  # None once planned: the C layer cannot run this layer
    _planned = False
    lora_rows: StepRows | None = None  # which of a step's rows use an adapter (model/lora.py), where any may

    @property
    def adapted_step(self) -> bool:
        """Some of this step's rows use an adapter, which only the modules apply."""
        return self.lora_rows is not None and bool(self.lora_rows.groups)

    def c_plan_for(self, dtype: torch.dtype) -> ops.DecoderLayerPlan | None:
        """The plan where this layer runs as one C call on activations of `dtype` (bf16 only); else None."""
        return self.c_plan() if self.c_layer and dtype == torch.bfloat16 else None

    def c_plan(self) -> ops.DecoderLayerPlan | None:
        """The layer as decoder_layer.c takes it, built on first use; None where that C path cannot run it."""
        if not self._planned:
            self._plan, self._planned = self._build_plan(), True
        return self._plan

    def _build_plan(self) -> ops.DecoderLayerPlan | None:
        raise NotImplementedError

    def c_plan_for_step(self, x: torch.Tensor, kv_cache: KVCache) -> ops.DecoderLayerPlan | None:
        """The plan where this step runs this layer in C: bf16 activations and a bf16 or int8 cache, no adapter
        rows; else None."""
        return None if self.adapted_step else cache_plan(self.c_plan_for(x.dtype), kv_cache)

    def c_call(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor | None:
        """The layer as one C call where it can run so (its output), else None: the modules' turn."""
        plan = self.c_plan_for_step(x, kv_cache)
        if plan is None:
            return None
        keys = meta.key_lists(self.window)
        cos, signed_sin = flat_rope(rope)
        return ops.decoder_layer(self.c_kernel, plan, x, cos, signed_sin, kv_cache, meta.slot_mapping, *keys.astuple())

    @property
    def window(self) -> int | None:
        """The sliding window of this layer's attention (None: it sees the whole context)."""
        window: int | None = self.self_attn.window
        return window


def flat_rope(rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) as the C layer takes them: (T, head_dim), contiguous (Rotary's rows already are)."""
    return rope[0][:, 0].contiguous(), rope[1][:, 0].contiguous()


class LayerStack:
    """A step's layers in one C call (ops.decoder_stack) where each would run as its own C call of the same kernel and
    they use at most STACK_KINDS (rope, window) pairs between them; the same kernels in the same order, so the same
    bits. The per-layer array (plans and caches) is built once for a set of caches and kept while they are in use;
    which modules are C layers, and their windows, are read then too (fixed once a model is built), so that a step
    only matches its ropes to the kinds.
    """

    enabled: ClassVar[bool] = True  # the tests turn it off to compare with a call per layer

    def __init__(self) -> None:
        self._whole: StepPlan | None = None  # the step from its ids in one call (forward_ids), where it can run so
        self._whole_caches: Sequence[KVCache] | None = None  # the caches _whole was built for
        self._caches: Sequence[KVCache] | None = None  # the caches the array was built for (the runner's, kept)
        self._layers: list[CLayer] = []  # the modules, where every one is a C layer (else empty: no stack)
        self._windows: list[int | None] = []  # their attention's windows
        self._kinds: list[tuple[int, int | None]] = []  # each layer's (its rope's first layer, window)
        self._distinct: list[tuple[int, int | None]] = []  # those pairs in order of first use: kind k is the k-th
        self._array: ctypes.Array[ops.StackLayer] | None = None
        self._gemma = False

    def forward_ids(
        self,
        model: Any,
        input_ids: Sequence[int],
        positions: Sequence[int],
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        greedy: tuple[torch.Tensor, torch.Tensor, int, list[int]] | None = None,
        reuse: bool = False,
        lora: ops.LoraStep | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None] | None:
        """The final norm's output for the step's token ids in one C call (ops.decoder_forward): the embedding, the
        rotary rows, the layers and the final norm, the same kernels in the same order as the modules' path, so the
        same bits. None where the model cannot run so (its embedding is no GGUF table, a layer is no C layer, ...):
        the caller embeds and calls `forward`. Built once for a set of caches, as `forward`'s array. `greedy`: the
        last row's greedy head in the same call (ops.decoder_forward), whose (logits, argmax) come second: the logits
        are the plan's, overwritten by the next such call. `reuse`: the output is the plan's too (an engine step's,
        read before the next), so that a decode step makes no torch call at all. `lora`: the updates of the adapters
        that the step's rows use (model/lora.py's AdapterSlots.c_step)."""
        if not self.enabled:
            return None
        if kv_caches is not self._whole_caches:
            self._whole, self._whole_caches = StepPlan.build(model, kv_caches), kv_caches
        whole = self._whole
        if whole is None:
            return None
        whole.point_at_tables(max(meta.context_lens))
        step = ops.StackKinds()
        step.lora = ctypes.addressof(lora) if lora is not None else None
        keep = []  # the arrays `step` points into, alive through the call
        slots = whole.slots_address(meta.slots)
        for k, window in enumerate(whole.windows):
            # plain ctypes arrays, not tensors: each torch call here would find its code cold after the last step
            offset, count = ((ctypes.c_int64 * len(b))(*b) for b in key_list_bounds(meta, window))
            keep += [offset, count]
            step.slots[k] = slots
            step.offset[k], step.count[k] = ctypes.addressof(offset), ctypes.addressof(count)
        t, head = len(input_ids), None
        if greedy is not None:
            head = whole.greedy_head(*greedy)
        out = whole.output(t) if reuse else None
        hidden = ops.decoder_forward(
            whole.gemma,
            whole.plan,
            whole.layers,
            step,
            input_ids,
            positions,
            whole.hidden,
            meta.new_slots,
            whole.scratch(t),
            out,
            head,
        )
        if greedy is None or head is None:
            return hidden, None
        argmax = ops.greedy_answer(head, whole.hidden, greedy[3])
        return hidden, (whole.logits, argmax) if argmax is not None else None

    def forward(
        self,
        modules: Iterable[object],
        x: torch.Tensor,
        ropes: Sequence[Rope],
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The last layer's output, or None where the layers cannot run as one call (the caller loops over them)."""
        if not self.enabled or x.dtype != torch.bfloat16:
            return None
        if kv_caches is not self._caches:
            modules = list(modules)
            layers = [layer for layer in modules if isinstance(layer, CLayer)]
            self._layers = layers if len(layers) == len(modules) else []
            self._windows = [layer.window for layer in self._layers]
            self._caches, self._kinds = kv_caches, []
        if not self._layers:
            return None
        first: dict[int, int] = {}  # a rope's first layer, which stands for it (layers of one kind share one rope)
        kinds = [(first.setdefault(id(r), i), window) for i, (r, window) in enumerate(zip(ropes, self._windows))]
        if kinds != self._kinds:
            self._array = self._build(self._layers, kv_caches, kinds)
            self._kinds = kinds
        if self._array is None:
            return None
        step = ops.StackKinds()
        keep = []  # the tensors `step` points into, alive through the call (the key lists stay in `meta`)
        for k, (at, window) in enumerate(self._distinct):
            cos, signed_sin = flat_rope(ropes[at])
            keys = meta.key_lists(window)
            keep += [cos, signed_sin]
            step.cos[k], step.signed_sin[k] = cos.data_ptr(), signed_sin.data_ptr()
            step.slots[k], step.offset[k], step.count[k] = (t.data_ptr() for t in keys.astuple())
        return ops.decoder_stack(self._gemma, self._array, step, x, meta.slot_mapping)

    def _build(
        self,
        layers: list[CLayer],
        kv_caches: Sequence[KVCache],
        kinds: list[tuple[int, int | None]],
    ) -> ctypes.Array[ops.StackLayer] | None:
        built = stack_entries(layers, kv_caches, kinds)
        if built is None:
            return None
        array, self._distinct, self._gemma = built
        return array


def cache_plan(plan: ops.DecoderLayerPlan | None, kv_cache: KVCache) -> ops.DecoderLayerPlan | None:
    """`plan` told its cache's kind (kv_int8), where the C layer takes that cache (bf16, or int8 rows); else None."""
    if plan is None or kv_cache[0].dtype not in (torch.bfloat16, torch.int8):
        return None
    plan.kv_int8 = int(kv_cache[0].dtype == torch.int8)
    return plan


def stack_entries(
    layers: list[CLayer], kv_caches: Sequence[KVCache], kinds: Sequence[Hashable]
) -> tuple[ctypes.Array[ops.StackLayer], list[Any], bool] | None:
    """Each layer's entry of a decoder_stack call (its plan, its caches, the index of its kind among the distinct
    kinds, in order of first use), the distinct kinds, and whether the layers are Gemma 3's; None where a layer cannot
    run in C on bf16 activations and caches, the layers' kernels differ, or the kinds are more than STACK_KINDS."""
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) > ops.STACK_KINDS or len({layer.c_kernel for layer in layers}) != 1:
        return None
    bf16 = [cache_plan(layer.c_plan_for(torch.bfloat16), kv) for layer, kv in zip(layers, kv_caches)]
    plans = [plan for plan in bf16 if plan is not None]
    if len(plans) != len(layers) or len(kv_caches) != len(layers):
        return None
    array = (ops.StackLayer * len(layers))()
    for entry, plan, (k_cache, v_cache), kind in zip(array, plans, kv_caches, kinds):
        entry.plan, entry.kind = ctypes.addressof(plan), distinct.index(kind)
        entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    return array, distinct, layers[0].c_kernel == "gemma3_layer"


class StepPlan:
    """What ops.decoder_forward takes of a model for a set of caches: the forward plan (the embedding's GGUF blocks and
    scale, the final norm, each kind's rotary tables), every layer's entry and the kinds' windows. A kind is a pair
    (rotary module, window): Gemma 3's sliding and global layers are two, a Llama-family model's one."""

    def __init__(
        self,
        gemma: bool,
        plan: ops.ForwardPlan,
        layers: ctypes.Array[ops.StackLayer],
        rotaries: list[Any],
        windows: list[int | None],
        hidden: int,
    ) -> None:
        self.gemma, self.plan, self.layers, self.hidden = gemma, plan, layers, hidden  # (each layer keeps its plan)
        self.rotaries, self.windows = rotaries, windows  # per kind
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # the rotary tables the plan points into
        self._scratch, self._scratch_rows, self._scratch_at = torch.empty(0), 0, 0
        self._output, self._output_rows = torch.empty(0), 0
        self._view, self._view_rows = (self._output, 0), 0  # the last output view, and its rows (0: none yet)
        self._slots: tuple[torch.Tensor | None, int] = (None, 0)
        self._head: tuple[torch.Tensor | None, torch.Tensor | None, int, int, int, int] = (None, None, 0, 0, 0, 0)
        self.logits = torch.empty(1, 0)  # a lone greedy row's logits, as its head wrote them

    @classmethod
    def build(cls, model: Any, kv_caches: Sequence[KVCache]) -> StepPlan | None:
        layers = list(model.model.layers)
        embed, norm = model.model.embed_tokens, model.model.norm
        if not layers or not all(isinstance(layer, CLayer) for layer in layers) or not _embeds_in_c(embed):
            return None
        weighted = not norm.offset
        if weighted and norm.weight.dtype != torch.bfloat16:  # RMSNorm's torch path: not the C norm
            return None
        built = stack_entries(layers, kv_caches, list(zip(model.layer_rotaries(), (layer.window for layer in layers))))
        if built is None:
            return None
        array, distinct, gemma = built
        raw = embed.get_buffer("raw")
        forward = ops.ForwardPlan(
            embed=raw.data_ptr(),
            embed_rows=raw.shape[0],
            embed_type=embed.ggml_type,
            embed_scale=model.embed_scale() or 0.0,
            norm_eps=norm.eps,
            norm=norm.factor.data_ptr(),
            norm_weighted=int(weighted),
        )
        hidden = layers[0].c_plan().hidden  # (stack_entries found every layer's plan)
        if embed.k != hidden:
            return None
        return cls(gemma, forward, array, [r for r, _ in distinct], [w for _, w in distinct], hidden)

    # What the plan keeps from call to call, and the addresses it read once: after a step has streamed the weights
    # through the caches, each torch call (an allocation, a view, even a data_ptr) finds its code cold.

    def scratch(self, rows: int) -> int:
        """The address of room for the call's two spare buffers of `rows` rows each."""
        if self._scratch_rows < rows:
            self._scratch_rows = max(rows, 2 * self._scratch_rows)  # grown to twice what it held, at least
            self._scratch = torch.empty(2 * self._scratch_rows, self.hidden, dtype=torch.bfloat16)
            self._scratch_at = self._scratch.data_ptr()
        return self._scratch_at

    def output(self, rows: int) -> tuple[torch.Tensor, int]:
        """A (rows, hidden) bf16 output and its address, overwritten by the next call that takes it: the same view
        while `rows` does not change (a decode step's one row)."""
        if self._output_rows < rows:
            self._output_rows = max(rows, 2 * self._output_rows)
            self._output = torch.empty(self._output_rows, self.hidden, dtype=torch.bfloat16)
            self._view_rows = 0
        if self._view_rows != rows:
            self._view, self._view_rows = (self._output[:rows], self._output.data_ptr()), rows
        return self._view

    def slots_address(self, slots: torch.Tensor) -> int:
        """slots.data_ptr(), read again only for another tensor (the runner keeps one while the blocks stay)."""
        if slots is not self._slots[0]:
            self._slots = (slots, slots.data_ptr())
        return self._slots[1]

    def greedy_head(self, high6: torch.Tensor, packed: torch.Tensor, n: int, keep: list[int]) -> ops.GreedyHead:
        """ops.greedy_head over the head's 6-bit copy and regrouped rows (GgufLinear.greedy_parts), of width n,
        writing into `logits`."""
        if high6 is not self._head[0] or packed is not self._head[1] or self._head[2] != n:
            self.logits = torch.empty(1, n, dtype=torch.float32)
            self._head = (high6, packed, n, high6.data_ptr(), packed.data_ptr(), self.logits.data_ptr())
        _, _, _, high6_at, packed_at, logits_at = self._head
        return ops.greedy_head(high6_at, packed_at, logits_at, n, keep)

    def point_at_tables(self, furthest: int) -> None:
        """Every kind's rotary tables cover positions below `furthest` (a grown table is a new tensor, pointed at)."""
        tables = [rotary.tables(furthest, torch.bfloat16) for rotary in self.rotaries]
        if len(tables) == len(self._tables) and all(a[0] is b[0] for a, b in zip(tables, self._tables)):
            return
        for k, (cos, signed_sin) in enumerate(tables):
            self.plan.cos[k], self.plan.signed_sin[k] = cos.data_ptr(), signed_sin.data_ptr()
            self.plan.rope_rows[k] = cos.shape[0]
        self._tables = tables


def _embeds_in_c(embed: Any) -> bool:
    """The embedding is a GGUF table (GgufEmbedding, bf16 rows) whose blocks gguf_dequant.c decodes."""
    if not isinstance(embed, GgufEmbedding) or embed.dtype != torch.bfloat16 or ops.library() is None:
        return False
    raw = embed.get_buffer("raw")
    if raw.dim() != 2 or raw.dtype != torch.uint8 or not raw.is_contiguous():
        return False
    try:
        ops.gguf_dequantize_rows(raw, embed.ggml_type, embed.k, torch.zeros(1, dtype=torch.int64))
    except ValueError:
        return False
    return True


def projections(attn: Any, mlp: Any) -> tuple[Any, ...]:
    """A layer's four projections, in PROJECTIONS' order (its attention and MLP modules name them alike), without
    their adapters (model/lora.py)."""
    return tuple(unwrap(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


def plannable(attn: Any, mlp: Any) -> bool:
    """The kernels are built, every projection is GGUF blocks the C matmul takes, and the shapes fit the kernels."""
    return (
        ops.library() is not None
        and ops.decoder_layer_available()
        and all(
            isinstance(m, GgufLinear) and m.kernel and len(m.types) <= ops.GGUF_LINEAR_MAX_PARTS
            for m in projections(attn, mlp)
        )
        and attn.head_dim % 16 == 0
        and attn.head_dim <= min(ops.MAX_ATTENTION_HEAD_DIM, ops.MAX_HEAD_DIM)
        and projections(attn, mlp)[2].out_features % 32 == 0
    )


def layer_plan(attn: Any, mlp: Any, **fields: Any) -> ops.DecoderLayerPlan:
    """The plan: the shapes and the attention's scale from the layer's modules, `fields` the rest (eps, the norms'
    factors' addresses), and the four projections' parts (qkv, o, gate_up, down)."""
    linears = projections(attn, mlp)
    plan = ops.DecoderLayerPlan(
        hidden=linears[1].out_features,
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        ffn=linears[2].out_features // 2,
        scale=attn.scale,
        softcap=0.0,
        **fields,
    )
    for field, linear in zip(PROJECTIONS, linears, strict=True):
        assert isinstance(linear, GgufLinear)
        projection = getattr(plan, field)
        projection.k, projection.n = linear.k, linear.out_features
        parts = linear.kernel_parts()
        projection.parts = len(parts)
        for i, (ggml_type, packed, n, at) in enumerate(parts):
            projection.part[i] = ops.GgufPart(ggml_type, packed.data_ptr(), n, at)
    return plan
