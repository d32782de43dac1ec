"""The bench only ever talks to this machine: 127.0.0.0/8, ::1 or localhost."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class NotLoopbackError(ValueError):
    """The URL points somewhere other than this machine's loopback interface."""


def require_loopback(url: str) -> str:
    """Return the base URL without a trailing slash, or raise NotLoopbackError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise NotLoopbackError(f"{url!r}: only http(s) URLs can be benchmarked")
    host = parts.hostname
    if not host or not is_loopback_host(host):
        raise NotLoopbackError(f"{url!r}: the bench only drives servers on 127.0.0.0/8, ::1 or localhost")
    return url.rstrip("/")


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name could resolve anywhere
    if isinstance(address, ipaddress.IPv6Address):
        return address == ipaddress.IPv6Address("::1")
    return address in ipaddress.IPv4Network("127.0.0.0/8")
