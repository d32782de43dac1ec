from __future__ import annotations

import pytest

from tokenmill.bench.loopback import NotLoopbackError, require_loopback


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.1.2.3:9", "http://127.1.2.3:9"),
        ("http://localhost:8000", "http://localhost:8000"),
        ("http://LOCALHOST:8000", "http://LOCALHOST:8000"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("https://127.0.0.1", "https://127.0.0.1"),
    ],
)
def test_loopback_urls_are_accepted(url: str, expected: str) -> None:
    assert require_loopback(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://0.0.0.0:8000",
        "http://192.168.1.5",
        "http://128.0.0.1",
        "http://[::2]:8000",
        "http://[::ffff:8.8.8.8]:80",
        "http://example.com",
        "http://localhost.example.com",
        "http://127.0.0.1.nip.io",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "http://",
    ],
)
def test_other_hosts_are_refused(url: str) -> None:
    with pytest.raises(NotLoopbackError):
        require_loopback(url)
