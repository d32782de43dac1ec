"""CORS: which web pages on other origins a browser lets call the API (--allowed-origins and vLLM's other flags).

Starlette's CORSMiddleware does the work; it sits outside the API-key check, so a browser's preflight (an OPTIONS
request that carries no key) is answered, while the request that follows still needs the key.

The default lets pages served from this machine (localhost, 127.0.0.1, [::1], any port) call it, and no others. vLLM
allows every origin, but a server that runs without a key by default would then serve any web page its user visits,
which could use the model and read its answers; Ollama draws the line at the same place.
"""

from __future__ import annotations

import re
from typing import Any

from tokenmill.config import Config

ANY = "*"
ANY_PORT = ":*"
# what a page's script may read of an answer besides the safelisted headers: its id, and when and how much to retry
RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{dimension}"
    for what in ("limit", "remaining", "reset")
    for dimension in ("requests", "tokens")
)
EXPOSED = ("x-request-id", "retry-after", *RATE_LIMIT_HEADERS)


def cors_options(config: Config) -> dict[str, Any]:
    """CORSMiddleware's arguments: exact origins as they are, `scheme://host:*` as a pattern for any port."""
    origins = list(config.allowed_origins)
    exact = [o for o in origins if not o.endswith(ANY_PORT)]
    any_port = [re.escape(o.removesuffix(ANY_PORT)) + r":[0-9]{1,5}" for o in origins if o.endswith(ANY_PORT)]
    return {
        "allow_origins": [ANY] if ANY in exact else exact,
        "allow_origin_regex": "|".join(any_port) if any_port and ANY not in exact else None,
        "allow_methods": list(config.allowed_methods),
        "allow_headers": list(config.allowed_headers),
        "allow_credentials": config.allow_credentials,
        "expose_headers": list(EXPOSED),
    }
