"""LoRA adapter files → each adapted linear's low-rank update, in Hugging Face module names and conventions.

Two formats, as their tools write them:
- a PEFT directory: `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`) and
  `adapter_model.safetensors`, whose keys are `base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight`
  (out, r); the update is W + scale · B·A with scale = alpha / r (rsLoRA: alpha / √r).
- a GGUF LoRA as llama.cpp's convert_lora_to_gguf.py writes it: `general.type = adapter`, `adapter.type = lora`,
  `adapter.lora.alpha`, tensors `blk.N.<tensor>.weight.lora_a` / `.lora_b` under the base file's names, Llama's q/k
  rows of B permuted as the base file's are; llama.cpp's scale is alpha / r (alpha 0: 1).

What changes more than the linears (DoRA's magnitudes, biases, embedding or head updates, modules saved whole) is
refused with an error that says what and where, never dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from tokenmill.model.loading.gguf_convert import hf_name, unpermute_rotary
from tokenmill.model.loading.gguf_file import GgufFormatError, read_gguf_file
from tokenmill.model.model_config import ModelConfig, UnsupportedModelError

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>[a-z_]+)$")


class AdapterError(ValueError):
    """An adapter this engine cannot serve as it is: the message says which file, what, and why, in one line."""


@dataclass(frozen=True)
class LowRank:
    """One linear's update: W' = W + scale · b @ a."""

    a: torch.Tensor  # (r, in) float32
    b: torch.Tensor  # (out, r) float32
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterFile:
    path: str
    built_for: str  # the base it names (PEFT's base_model_name_or_path, a GGUF's architecture), for errors
    modules: dict[str, LowRank]  # Hugging Face module path (model.layers.3.self_attn.q_proj) → its update
    digest: str  # SHA-256 of the weights' file: what the prefix cache keys an adapter's KV on

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def read_adapter(path: str, config: ModelConfig) -> AdapterFile:
    """A PEFT directory or a GGUF LoRA file, checked for what the engine can apply to a `config` model."""
    source = Path(path).expanduser()
    if source.is_dir():
        return _read_peft(source)
    if source.is_file():
        return _read_gguf(source, config)
    raise AdapterError(f"no LoRA adapter at {path}: expected a PEFT directory ({PEFT_CONFIG}) or a GGUF LoRA file")


# --- PEFT -----------------------------------------------------------------------------------------------------------
def _read_peft(directory: Path) -> AdapterFile:
    config_path, weights = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    if not config_path.is_file():
        raise AdapterError(f"{directory} has no {PEFT_CONFIG}: not a PEFT adapter directory")
    if not weights.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        why = " (adapter_model.bin is a pickle, which is never loaded: save with safe_serialization)" if pickled else ""
        raise AdapterError(f"{directory} has no {PEFT_WEIGHTS}{why}")
    settings = json.loads(config_path.read_text())
    _check_peft_settings(directory, settings)
    alpha = float(settings.get("lora_alpha", 8))
    rs = bool(settings.get("use_rslora", False))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors handle is no dict)
            match = _PEFT_KEY.match(key)
            if match is None:
                raise AdapterError(f"{weights}: tensor {key!r} is no LoRA A or B of a linear (only those are applied)")
            halves.setdefault(match["module"], {})[match["ab"]] = f.get_tensor(key).float()
    modules = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights}: {module} has lora_{'A' if 'A' in ab else 'B'} without its other half")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
        module_alpha = float(_pattern_value(settings.get("alpha_pattern") or {}, module, alpha))
        rank = a.shape[0]
        modules[module] = LowRank(a, b, module_alpha / (math.sqrt(rank) if rs else rank))
    built_for = str(settings.get("base_model_name_or_path") or "an unnamed base")
    return AdapterFile(str(directory), built_for, modules, _sha256(weights))


def _check_peft_settings(directory: Path, settings: dict[str, Any]) -> None:
    kind = settings.get("peft_type", "LORA")
    refusals = {
        "peft_type": (kind != "LORA", f"is {kind!r}; only LORA adapters are served"),
        "use_dora": (settings.get("use_dora"), "is set; DoRA's magnitude vectors are not applied by this engine"),
        "lora_bias": (settings.get("lora_bias"), "is set; LoRA B biases are not applied by this engine"),
        "modules_to_save": (settings.get("modules_to_save"), "lists modules saved whole; only LoRA updates apply"),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise AdapterError(f"{directory / PEFT_CONFIG}: {field} {why}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module whose name ends with it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


# --- GGUF (llama.cpp) -----------------------------------------------------------------------------------------------
def _read_gguf(path: Path, config: ModelConfig) -> AdapterFile:
    try:
        meta, tensors = read_gguf_file(str(path))
    except GgufFormatError as exc:
        raise AdapterError(f"{path}: {exc}") from exc
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is no GGUF LoRA adapter (general.type {meta.get('general.type')!r})")
    arch = str(meta.get("general.architecture"))
    if arch != config.architecture:
        raise AdapterError(f"adapter {path} was built for a {arch} model; the model served is {config.architecture}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in tensors:
        base, _, half = tensor.name.rpartition(".lora_")
        if half not in ("a", "b"):
            raise AdapterError(f"{path}: tensor {tensor.name!r} is no lora_a or lora_b of a linear")
        try:
            name = hf_name(base, arch)
        except UnsupportedModelError as exc:
            raise AdapterError(f"{path}: {exc}") from exc
        if not name.endswith(".weight") or name.startswith(("model.embed_tokens", "lm_head")):
            raise AdapterError(f"{path}: {tensor.name} adapts no decoder layer's linear (only those are applied)")
        values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        matrix = torch.from_numpy(values).reshape(tuple(reversed(tensor.shape)))
        halves.setdefault(name.removesuffix(".weight"), {})[half] = matrix
    modules = {}
    for module, ab in halves.items():
        if set(ab) != {"a", "b"}:
            raise AdapterError(f"{path}: {module} has one of lora_a and lora_b without the other")
        a, b = ab["a"], ab["b"]
        if arch == "llama" and module.endswith((".q_proj", ".k_proj")):  # the base file's rotary permutation
            b = unpermute_rotary(b, config.num_heads if module.endswith(".q_proj") else config.num_kv_heads)
        rank = a.shape[0]
        modules[module] = LowRank(a, b.contiguous(), alpha / rank if alpha else 1.0)
    return AdapterFile(str(path), f"a {arch} model", modules, _sha256(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def layer_and_name(module: str) -> tuple[int, str] | None:
    """`model.layers.3.self_attn.q_proj` → (3, "q_proj"); None for a module outside the decoder layers."""
    match = _LAYER_MODULE.match(module)
    return None if match is None else (int(match["layer"]), match["name"])
