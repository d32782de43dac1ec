"""The start-up banner: where the server listens, each model and what it runs on, and a curl line to paste.

The engine describes itself (`description`: dtype, quantisation, KV capacity, the C kernels it calls), so this module
needs neither torch nor the kernels. With API keys set, the curl line shows `$KEY`, never a key.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Iterable
from typing import Any

from tokenmill.api.engine_protocol import Engine

log = logging.getLogger("tokenmill.banner")

EXAMPLE_PROMPT = "Once upon a time"


def url_of(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def model_facts(engine: Engine) -> dict[str, Any]:
    """What the banner says of one model (its name and context only, for an engine that does not describe itself)."""
    facts: dict[str, Any] = {"model": engine.model_name, "max_model_len": engine.max_model_len}
    description = engine.description
    if description is not None:
        facts.update(
            dtype=description.dtype,
            quantization=description.quantization,
            kv_cache_tokens=description.kv_cache_tokens,
            kernels=list(description.kernels),
            kv_ram_bytes=description.kv_ram_bytes,
            kv_disk_dir=description.kv_disk_dir,
            kv_disk_bytes=description.kv_disk_bytes,
        )
    return facts


def curl_line(url: str, model: str, with_key: bool) -> str:
    body = json.dumps({"model": model, "prompt": EXAMPLE_PROMPT, "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $KEY"' if with_key else ""
    return f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"


def banner(url: str, engines: Iterable[Engine], with_key: bool) -> tuple[str, dict[str, Any]]:
    """The banner's text, and the same as fields (a JSON log's line carries those)."""
    models = [model_facts(engine) for engine in engines]
    curl = curl_line(url, models[0]["model"], with_key)
    lines = [f"tokenmill is serving on {url}"]
    lines += [f"  {_describe(facts)}" for facts in models]
    lines.append(f"  try: {curl}")
    return "\n".join(lines), {"url": url, "models": models, "curl": curl}


def _describe(facts: dict[str, Any]) -> str:
    parts = [f"context {facts['max_model_len']} tokens"]
    if "dtype" in facts:
        kernels = ", ".join(facts["kernels"]) or "none (torch only)"
        parts = [
            facts["dtype"],
            "unquantised weights" if facts["quantization"] == "none" else f"{facts['quantization']} weights",
            *parts,
            f"KV cache {facts['kv_cache_tokens']} tokens",
            _tiers(facts),
            f"C kernels: {kernels}",
        ]
    return f"{facts['model']}: " + "; ".join(parts)


def _tiers(facts: dict[str, Any]) -> str:
    """The prefix cache's tiers past the live cache: "prefix cache tiers: RAM 4.0 GiB, disk 10.0 GiB in DIR"."""
    tiers = [f"RAM {facts['kv_ram_bytes'] / (1 << 30):.1f} GiB"] if facts["kv_ram_bytes"] else []
    if facts["kv_disk_dir"]:
        tiers.append(f"disk {facts['kv_disk_bytes'] / (1 << 30):.1f} GiB in {facts['kv_disk_dir']}")
    return "prefix cache tiers: " + (", ".join(tiers) or "none")


def log_banner(url: str, engines: Iterable[Engine], with_key: bool) -> None:
    text, fields = banner(url, engines, with_key)
    log.info(text, extra={"fields": fields, "in_message": tuple(fields)})
