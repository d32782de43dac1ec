"""`system_fingerprint` changes when, and only when, something that can change outputs changes.

What can: the model file's contents (its SHA-256), the compute dtype, the quantisation mode, the KV cache's dtype,
tokenmill's version. Everything else in Config (where the file lies, ports, keys, limits, cache and batch sizes) must
leave it alone.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from tokenmill.config import Config
from tokenmill.server import fingerprint
from tokenmill.server.fingerprint import system_fingerprint

SOURCE = "a" * 64
OUTPUT_FIELDS = {"dtype", "quantization", "kv_cache_dtype"}


def test_fingerprint_is_stable_and_short() -> None:
    fingerprint = system_fingerprint(SOURCE, Config())
    assert fingerprint == system_fingerprint(SOURCE, Config())
    assert re.fullmatch(r"fp_[0-9a-f]{12}", fingerprint)


@pytest.mark.parametrize(
    ("source", "config"),
    [
        ("b" * 64, Config()),  # other weights
        (SOURCE, Config(dtype="float32")),
        (SOURCE, Config(dtype="bfloat16", quantization="none")),
        (SOURCE, Config(dtype="bfloat16", quantization="int4")),
        (SOURCE, Config(kv_cache_dtype="int8")),
    ],
)
def test_what_can_change_outputs_changes_the_fingerprint(source: str, config: Config) -> None:
    assert system_fingerprint(source, config) != system_fingerprint(SOURCE, Config())


def test_the_default_quantisation_is_the_gguf_files_own_with_bfloat16() -> None:
    assert system_fingerprint(SOURCE, Config()) == system_fingerprint(SOURCE, Config(quantization="gguf"))
    assert Config(dtype="float32").weight_quantization == "none"


def test_quantisation_modes_are_told_apart() -> None:
    prints = {
        system_fingerprint(SOURCE, Config(dtype="bfloat16", quantization=q)) for q in ("none", "gguf", "int8", "int4")
    }
    assert len(prints) == 4


def test_a_new_version_changes_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    before = system_fingerprint(SOURCE, Config())
    monkeypatch.setattr(fingerprint, "__version__", "99.0.0")
    assert system_fingerprint(SOURCE, Config()) != before


def _other_value(field: dataclasses.Field[Any]) -> Any:
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default * 2 + 1
    if isinstance(default, tuple):
        return {"kv_cache_weights": (2.0,), "lora": ("tuned=/adapters/tuned",)}.get(field.name, ("some-key",))
    if isinstance(default, str):
        others = {"log_level": "debug", "host": "0.0.0.0", "log_format": "json", "speculative": "off"}
        return others.get(field.name, default + "-other")
    if field.name.startswith("rate_limit_"):
        return "10/min"
    if field.name == "speculative_config":  # the same tokens with drafts as without
        return '{"method": "ngram"}'
    if field.name == "simulated_service_times":
        return "0.0464,0.0035,0.0059"
    counts = ("max_model_len", "num_kv_blocks", "threads", "replicas", "min_replicas", "max_replicas")
    counts += ("max_ingress_replicas",)
    return 7 if field.name in (*counts, "target_ongoing_requests", "kv_cache_ram_gb") else "/elsewhere/model.gguf"


COMPANIONS = {  # valid only so
    "min_replicas": {"max_replicas": 8},
    "target_ongoing_requests": {"max_replicas": 8},
    "simulate_engine": {"replicas": 2},
    "simulated_service_times": {"replicas": 2, "simulate_engine": True},
}


@pytest.mark.parametrize(
    "field", [f for f in dataclasses.fields(Config) if f.name not in OUTPUT_FIELDS], ids=lambda f: f.name
)
def test_nothing_else_changes_the_fingerprint(field: dataclasses.Field[Any]) -> None:
    changed = Config(**{field.name: _other_value(field), **COMPANIONS.get(field.name, {})})
    assert getattr(changed, field.name) != getattr(Config(), field.name)
    assert system_fingerprint(SOURCE, changed) == system_fingerprint(SOURCE, Config())
