"""Linear layers and embeddings that compute with a GGUF file's own quantised blocks, never widened.

A GGUF weight (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) stays in the file's quantisation: the C kernel
(kernels/gguf_matmul.c) multiplies with its blocks regrouped once at load into 16-column groups (about as many bytes
per column as the file), and the file's own pages are dropped from the process after that. Without the kernel, the
torch code of gguf_quant.py computes the same products (slower) from the file's mapped blocks. Either way a row's
result does not depend on what else shares the batch: the activations are quantised per row and every block's dot
product is an exact integer.

A layer may hold several parts (the q, k and v projections stacked into one, each with its file's type): each part
writes its own columns of one output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.kernels import huge_pages, ops
from tokenmill.model import gguf_quant


@dataclass(frozen=True)
class GgufWeight:
    """One tensor of a GGUF file as its blocks: (N, row bytes) uint8, for N rows of `k` weights of `ggml_type`."""

    ggml_type: int
    raw: torch.Tensor
    k: int
    file_backed: bool = False  # raw lies in a private, never-written mapping of the file (its pages can be dropped)

    @property
    def rows(self) -> int:
        return self.raw.shape[0]


def native(weight: GgufWeight) -> bool:
    """Whether GgufLinear computes with this tensor's blocks as they are (else it is dequantised at load)."""
    return weight.ggml_type in gguf_quant.SUPPORTED and weight.k % 32 == 0


class Regrouping:
    """The regroupings that GgufLinears ask for while a model is put together, run by `run` in one C call
    (ops.gguf_repack_all): a loader that builds the tokenizer on another thread meanwhile is not held up between
    tensors by that thread's long stretches with the GIL. Until then the modules' buffers are unwritten. The buffers
    come from one arena of huge pages (kernels/huge_pages.py): every decode step streams them."""

    def __init__(self) -> None:
        self._jobs: list[ops.RepackJob] = []
        self._arena = huge_pages.Arena()

    def empty(self, ggml_type: int, n: int, k: int) -> torch.Tensor:
        """An unwritten buffer for N rows of K weights of `ggml_type` in the kernel's layout."""
        return self._arena.empty(ops.gguf_packed_bytes(ggml_type, n, k))

    def add(self, part: GgufWeight, out: torch.Tensor, at: int) -> None:
        # a file's pages, read once to regroup, are dropped as each is done: the page cache keeps them, RSS need not
        self._jobs.append(ops.RepackJob(part.raw.contiguous(), part.ggml_type, part.k, out, at, part.file_backed))

    def run(self) -> None:
        ops.gguf_repack_all(self._jobs)
        self._jobs = []
        self._arena.trim()  # memory backed ahead for these weights and not taken goes back


class GgufLinear(nn.Module):
    """y = x @ W.T for W made of GGUF parts stacked by rows (e.g. q, k, v), all of the same input width.

    `regrouping`: where the kernel's layout is asked for, to be written when its owner runs it; without one it is
    written before this returns. `greedy_copy`: an LM head of one Q8_0 part also keeps its codes less their two low
    bits (ops.GGUF_Q8_0_HIGH6, 76% of its bytes), from which a lone greedy row's step reads the head (greedy_row)."""

    def __init__(
        self, parts: list[GgufWeight], regrouping: Regrouping | None = None, greedy_copy: bool = False
    ) -> None:
        super().__init__()
        self.k = parts[0].k
        if any(p.k != self.k for p in parts):
            raise ValueError("the stacked parts of a GgufLinear must share their input width")
        self.kernel = ops.gguf_matmul_available()
        runs = _same_type_runs(parts) if self.kernel else [[p] for p in parts]
        self.types = [run[0].ggml_type for run in runs]
        self.rows = [sum(p.rows for p in run) for run in runs]
        self.out_features = sum(self.rows)
        starts = [sum(self.rows[:i]) for i in range(len(runs))]  # each part's first output column
        self._calls = [(f"part{i}", t, n, at) for i, (t, n, at) in enumerate(zip(self.types, self.rows, starts))]
        self.high6: torch.Tensor | None = None  # the 6-bit copy (greedy_copy), where the kernel computes
        self._greedy_rest = 0  # calls left before greedy_row tries the copy again
        if not self.kernel:  # the torch path computes with the file's blocks
            for i, part in enumerate(parts):
                self.register_buffer(f"part{i}", part.raw)
            return
        own = regrouping is None
        regrouping = regrouping or Regrouping()
        for i, run in enumerate(runs):  # a run of parts of one type regrouped as one, each into its own groups
            out = regrouping.empty(self.types[i], self.rows[i], self.k)
            at = 0
            for part in run:
                regrouping.add(part, out, at)
                at += ops.gguf_packed_bytes(part.ggml_type, part.rows, part.k)
            self.register_buffer(f"part{i}", out)
        if greedy_copy and len(parts) == 1 and parts[0].ggml_type == gguf_quant.Q8_0:
            self.high6 = regrouping.empty(ops.GGUF_Q8_0_HIGH6, self.out_features, self.k)
            regrouping.add(GgufWeight(ops.GGUF_Q8_0_HIGH6, parts[0].raw, self.k, parts[0].file_backed), self.high6, 0)
        if own:
            regrouping.run()

    def _part(self, i: int) -> torch.Tensor:
        return self.get_buffer(f"part{i}")

    def kernel_parts(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """Each part as the C kernel takes it: (ggml type, regrouped blocks, its rows, its first output column)."""
        if not self.kernel:
            raise ValueError("this GgufLinear keeps the file's blocks for the torch path: no kernel parts")
        return [(t, self._part(i), n, at) for i, (_, t, n, at) in enumerate(self._calls)]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.k)
        dtype = out_dtype or x.dtype
        if not self.kernel:
            parts = [gguf_quant.gguf_matmul(rows, self._part(i), t, self.k) for i, t in enumerate(self.types)]
            return torch.cat(parts, dim=1).to(dtype).reshape(*shape[:-1], self.out_features)
        rows = _kernel_rows(rows)  # this runs ~100 times a decode step, so it stays lean
        written = dtype if dtype in _KERNEL_OUT else torch.float32
        out = torch.empty(rows.shape[0], self.out_features, dtype=written)
        if rows.shape[0]:
            for name, t, n, at in self._calls:
                packed = self._buffers[name]  # not get_buffer, whose lookup costs a microsecond a call
                assert packed is not None
                ops.gguf_matmul_into(rows, out, t, packed, n, at)
        if written != dtype:
            out = out.to(dtype)
        return out if len(shape) == 2 else out.reshape(*shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int], list[bool]] | None:
        """An LM head's float32 logits (N, out_features) for x (N, K), with each row's argmax and whether the row is
        all finite, found in the kernel's own pass (ops.gguf_matmul_logits); None where the head is not one kernel
        call (the torch path, or parts of several types), and the caller takes forward's logits instead."""
        if not self.kernel or len(self._calls) != 1:
            return None
        name, t, n, _ = self._calls[0]
        return ops.gguf_matmul_logits(_kernel_rows(x.reshape(-1, self.k)), t, self.get_buffer(name), n)

    def greedy_row(self, x: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, int] | None:
        """One row's logits for greedy decoding from the head's 6-bit copy (ops.gguf_greedy_row): exact where they
        can hold the row's largest value and at `keep` (sorted ids), -inf elsewhere, and the row's argmax; None
        without the copy or where the kernel cannot answer (the caller takes `logits`). A row it could not answer
        cost the copy's pass on top of the full one, and the next rows of a stretch of text that flat likely would
        too: after one, the next GREEDY_REST calls go straight to the full pass."""
        if self.high6 is None or x.shape[0] != 1:
            return None
        if self._greedy_rest:
            self._greedy_rest -= 1
            return None
        copy = self.greedy_parts()
        assert copy is not None  # the copy is there and not resting
        found = ops.gguf_greedy_row(_kernel_rows(x.reshape(-1, self.k)), *copy, keep)
        if found is None:
            self.greedy_missed()
        return found

    def greedy_parts(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """What a lone greedy row's pass reads (the 6-bit copy, the regrouped head, its width), where the next row is
        to try it; None without the copy, or while the rows after a miss go to the full pass (greedy_row counts
        them, so a row that finds the copy resting here goes on to greedy_row)."""
        if self.high6 is None or self._greedy_rest:
            return None
        name, _, n, _ = self._calls[0]
        return self.high6, self.get_buffer(name), n

    def greedy_missed(self) -> None:
        """The copy could not answer a row: the next GREEDY_REST rows take the full pass."""
        self._greedy_rest = GREEDY_REST


_KERNEL_OUT = (torch.bfloat16, torch.float32)
GREEDY_REST = 16  # lone greedy rows sent straight to the full pass after one the head's copy could not answer


def _kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """(N, K) rows as the kernel takes them: bf16, each row contiguous (it writes bf16 or float32)."""
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _same_type_runs(parts: list[GgufWeight]) -> list[list[GgufWeight]]:
    """Neighbouring parts of one type (gate and up, often q and k) grouped to be computed as one: one kernel call
    instead of two. Rows are independent outputs, so a run computes exactly what its parts did. A part joins the run
    before it only if that run's rows fill whole 16-column groups, so that each part's groups follow the last's in
    the regrouped layout, and no part is copied to be joined."""
    runs: list[list[GgufWeight]] = []
    for part in parts:
        last = runs[-1] if runs else None
        if last and last[0].ggml_type == part.ggml_type and sum(p.rows for p in last) % ops.GGUF_GROUP == 0:
            last.append(part)
        else:
            runs.append([part])
    return runs


class GgufEmbedding(nn.Module):
    """Embedding rows dequantised from the file's blocks at lookup (the table stays in the file's memory map)."""

    def __init__(self, weight: GgufWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.ggml_type, self.k, self.dtype = weight.ggml_type, weight.k, dtype
        self.register_buffer("raw", weight.raw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raw = self.get_buffer("raw")
        if ops.library() is not None and raw.is_contiguous():  # one C loop, the same bits as the torch decoding
            return ops.gguf_dequantize_rows(raw, self.ggml_type, self.k, ids).to(self.dtype)
        return gguf_quant.dequantize_rows(raw, self.ggml_type, self.k, ids).to(self.dtype)


def adopt_gguf(
    model: nn.Module,
    quantized: dict[str, GgufWeight],
    stacked: dict[str, tuple[str, ...]],
    dtype: torch.dtype,
    greedy_head: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Give a freshly built (meta) model GgufLinear / GgufEmbedding modules for the weights kept as GGUF blocks.

    `quantized` maps Hugging Face weight names to the file's blocks. Stacked projections (q/k/v, gate/up) become one
    GgufLinear of several parts; a tied head reads the embedding's blocks. Returns the new modules' state dict
    entries (a strict load then sees every key), and as float tensors the quantised weights left without such a
    module (a stacked part whose siblings are floats joins them as a float, before stacking). `greedy_head`: a Q8_0
    head also gets its 6-bit copy for lone greedy rows (GgufLinear's greedy_copy).
    """
    left = dict(quantized)
    entries: dict[str, torch.Tensor] = {}
    regrouping = Regrouping()  # every linear's blocks regrouped at the end, in one C call

    def place(name: str, module: nn.Module) -> None:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
        entries.update({f"{name}.{key}": value for key, value in module.state_dict().items()})

    for fused, parts in stacked.items():
        for key in [k for k in list(left) if k.endswith(f".{parts[0]}.weight")]:
            prefix = key[: -len(f"{parts[0]}.weight")]
            names = [f"{prefix}{p}.weight" for p in parts]
            if all(n in left for n in names):
                place(f"{prefix}{fused}", GgufLinear([left.pop(n) for n in names], regrouping))
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.weight" in left:
            place(name, GgufLinear([left.pop(f"{name}.weight")], regrouping, greedy_head and name == "lm_head"))
    embed = left.pop("model.embed_tokens.weight", None)
    if embed is not None:
        place("model.embed_tokens", GgufEmbedding(embed, dtype))
        if getattr(model, "lm_head", None) is None:  # tied: the head multiplies with the same blocks
            place("lm_head", GgufLinear([embed], regrouping, greedy_head))
    regrouping.run()
    floats = {name: gguf_quant.dequantize(w.raw, w.ggml_type, w.k).to(dtype) for name, w in left.items()}
    return entries, floats
