"""The process's log lines as text or as JSON (`--log-format`): tokenmill's own, the access log and uvicorn's alike.

A record may carry `fields` (a dict, through `extra`): text appends them as `key=value` pairs, quoting any value that
is not a plain word, so no client-sent text can start a new line or fake a field; JSON puts them in the line's object.
`in_message` names fields the message already says, which text leaves out. JSON is one object a line, ASCII only.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+=,{}-]+")  # a text field value shown as is; anything else is JSON-quoted


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields: dict[str, Any] = getattr(record, "fields", None) or {}
        skip = getattr(record, "in_message", ())
        pairs = " ".join(
            f"{key}={text_value(value)}" for key, value in fields.items() if key not in skip and value is not None
        )
        return f"{line} {pairs}" if pairs else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields: dict[str, Any] = getattr(record, "fields", None) or {}
        line.update((key, value) for key, value in fields.items() if value is not None)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def text_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, str) and _PLAIN.fullmatch(v) for v in value):
        return ",".join(value) if value else '""'
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    return json.dumps(value, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Every logger of the process writes to stderr through one handler, in `log_format` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if log_format == "json":
        logging.captureWarnings(True)  # a Python warning becomes a JSON line too, not raw text on stderr
