"""One adapter's packed update of a stacked linear, for the LoRA kernel's tests."""

from __future__ import annotations

import torch

from tokenmill.model.loading.lora_files import LowRank
from tokenmill.model.lora import LoraLinear, PackedUpdate, StepRows, _pack


def packed(widths: list[int], k: int, ranks: list[int], seed: int = 0) -> tuple[LoraLinear, PackedUpdate]:
    """A stacked linear of `widths` with one adapter's update of each part (rank per part), packed in bf16."""
    generator = torch.Generator().manual_seed(seed)
    wrapper = LoraLinear(torch.nn.Identity(), widths, k, StepRows())
    updates = [
        (i, LowRank(torch.randn(r, k, generator=generator), torch.randn(n, r, generator=generator), 0.5))
        for i, (n, r) in enumerate(zip(widths, ranks))
    ]
    return wrapper, _pack(wrapper, updates, torch.bfloat16)
