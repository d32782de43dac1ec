"""Test weights in GGUF's quantised blocks, for the torch reference (test_gguf_quant.py) and the C kernel, and a
tiny GGUF model run on its own blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gguf_quant import row_bytes
from tokenmill.model.linear import prepare_linears
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model

TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
N = 48
MIXED = [T.Q5_0, T.Q8_0, T.Q4_0]  # taken in turn: q, k and v of a layer get different types, as in real files
IDS = torch.tensor([2, 5, 9, 14, 3, 7, 11, 4, 8, 6])


def native_model(path: Path, cache: Path) -> CausalLM:
    """A GGUF file's model in bf16 on the file's own blocks (`--quantization gguf`)."""
    loaded = load_model_files(str(path), str(cache), torch.bfloat16, "gguf")
    model = build_model(loaded.config, loaded.state_dict, quantized=loaded.quantized)
    prepare_linears(model, "gguf")
    return model


def width(t: T) -> int:
    return 512 if t in (T.Q4_K, T.Q5_K, T.Q6_K) else 96  # K-quants' super-blocks are 256 wide


# Where each type's fp16 scales sit in its block (d, and dmin for Q4_K/Q5_K).
FP16_AT = {T.Q4_0: [0], T.Q5_0: [0], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_blocks(t: T, n: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of random bytes with small random fp16 scales: every bit of every field (signed and 6-bit scales,
    the high bits) takes both values, and no scale is an fp16 NaN or inf."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, row_bytes(t, k)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(n, -1, gguf.GGML_QUANT_SIZES[t][1])
    for at in FP16_AT[t]:
        d = ((torch.rand(blocks.shape[:2], generator=gen) - 0.25) * 1e-3).half()
        blocks[..., at : at + 2] = d.unsqueeze(-1).view(torch.uint8)
    return raw


def weights(t: T, n: int = N, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Test weights of type t: gguf-py's quantisation of normal weights where it has one (it has none for the
    K-quants, whose blocks are then random, see random_blocks)."""
    k = width(t)
    if t in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_blocks(t, n, k, seed), k
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(w, t)), k


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
