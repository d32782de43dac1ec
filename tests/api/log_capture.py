"""The access log's lines as the server would write them, in text or JSON, captured for the tests."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenmill.api.logs import JsonFormatter, TextFormatter

ACCESS_LOGGER = "tokenmill.access"


class Captured:
    def __init__(self) -> None:
        self.stream = io.StringIO()

    @property
    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()

    @property
    def messages(self) -> list[str]:
        """Text lines without their `time level logger: ` prefix."""
        return [line.split(f"{ACCESS_LOGGER}: ", 1)[1] for line in self.lines]

    def objects(self) -> list[dict[str, Any]]:
        """Each line parsed as JSON (a line that is not JSON fails the test)."""
        return [json.loads(line) for line in self.lines]


@contextmanager
def captured(log_format: str, logger: str = ACCESS_LOGGER) -> Iterator[Captured]:
    """Lines `logger` writes at INFO while the block runs, formatted as `--log-format log_format` formats them."""
    capture = Captured()
    handler = logging.StreamHandler(capture.stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    target = logging.getLogger(logger)
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        yield capture
    finally:
        target.removeHandler(handler)
        target.setLevel(level)
