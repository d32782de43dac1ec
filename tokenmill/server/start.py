"""`tokenmill serve` in one process: its models' files hashed ahead, the engines loaded, the app built and served.

The order matters: hashing is begun first, before this imports torch and the server's modules (which hold the GIL for
over a second; hashing needs none), so nothing at this module's top imports either (tests/server/test_start.py).
"""

from __future__ import annotations

import gc

from tokenmill.config import Config
from tokenmill.server.hash_ahead import back_weights_of_models_ahead, hash_models_ahead


def serve_forever(config: Config) -> int:
    """Serve every model the config names until a signal stops the server; the exit code."""
    hash_models_ahead(config)  # first: the imports below hold the GIL for over a second, and hashing needs none
    back_weights_of_models_ahead(config)  # nor does backing the weights' huge pages
    # Loading makes millions of objects (torch's import, a tokenizer's vocabulary and merges) and frees few of them:
    # the cyclic collector's full passes over them found next to nothing and cost ~0.5 s of a start. It is back on
    # once the models are loaded (freeze.freeze_loaded_objects); a start that fails exits.
    gc.disable()
    from tokenmill.api.app import create_app
    from tokenmill.engine.content_filter import ContentFilter
    from tokenmill.model.loading.memory import drop_weights_ahead
    from tokenmill.server.http_server import serve
    from tokenmill.server.load import ModelLoadError, load_engine

    if config.content_filter:  # a bad filter file fails the start before the models load
        ContentFilter.from_file(config.content_filter)
    engines = [load_engine(one) for one in config.per_model()]
    drop_weights_ahead()  # pages backed for a model that kept its weights otherwise (no C kernels here)
    names = [engine.model_name for engine in engines]
    if len(set(names)) < len(names):
        raise ModelLoadError(
            f"two models would be served as the same id ({', '.join(names)}): name them apart with"
            " --served-model-name or NAME=PATH"
        )
    return serve(create_app(engines, config), config)
