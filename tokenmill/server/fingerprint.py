"""The `system_fingerprint` every response carries: it names what can change outputs, and nothing else."""

from __future__ import annotations

import hashlib

from tokenmill import __version__
from tokenmill.config import Config


def system_fingerprint(source_id: str, config: Config) -> str:
    """Changes when, and only when, something that can change outputs changes: weights, dtype, quantisation, the KV
    cache's dtype, version."""
    key = f"{source_id}|{config.dtype}|{config.weight_quantization}|{__version__}"
    if config.kv_cache_dtype != "auto":  # (so that the fingerprints of servers without it stay what they were)
        key += f"|kv {config.kv_cache_dtype}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]
