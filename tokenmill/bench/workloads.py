"""The prompts of `tokenmill bench --workload`: what a workload asks, for speculative decoding to gain on or not.

- `free`: the bench's short open prompts (PROMPTS), whose answers are new text.
- `edit`: a function from a package tokenmill depends on, with a small change asked for; the answer must write most
  of the function out again, as code-editing tools ask of a model.
- `score`: a passage of a dependency's documentation and a question to answer by quoting it, as extraction and
  scoring pipelines ask.

The edit and score prompts are built from the installed packages' own source (`inspect`), named below, so that no
prompt is tokenmill's code and every machine with the same package versions gets the same prompts; a name a package
version no longer has is left out, and the run records the names it used.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

WORKLOADS = ("free", "edit", "score")

# the free workload, and the standard run's prompts
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):",
    "The three most important inventions of the nineteenth century were",
    "Here is a short recipe for tomato soup:",
    "In physics, the law of conservation of energy states that",
    "Dear hiring manager, I am writing to apply for",
    "The history of the Roman Empire began",
    "import numpy as np\n\ndef normalize(x):",
    "A good night's sleep matters because",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "My favourite places to visit in Japan are",
    "SELECT name, COUNT(*) FROM orders",
    "The main differences between cats and dogs are",
    "To learn a new language quickly, you should",
)

# functions of 20 to 60 lines, from packages of tokenmill's own dependencies
EDIT_SOURCES = (
    "fastapi.routing:request_response",
    "fastapi.routing:serialize_response",
    "starlette.routing:compile_path",
    "prometheus_client.exposition:choose_encoder",
    "prometheus_client.exposition:make_wsgi_app",
    "prometheus_client.exposition:_use_gateway",
    "uvicorn.config:resolve_reload_patterns",
    "tqdm.utils:envwrap",
)
# documented names whose docstrings are passages of prose of 500 to 1,600 characters
SCORE_SOURCES = (
    "prometheus_client.metrics:Counter",
    "prometheus_client.metrics:Gauge",
    "prometheus_client.metrics:Histogram",
    "prometheus_client.metrics:Summary",
    "prometheus_client.exposition:pushadd_to_gateway",
    "prometheus_client.exposition:delete_from_gateway",
    "pydantic.fields:PrivateAttr",
    "pydantic.fields:ComputedFieldInfo",
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    sources: tuple[str, ...]  # the package names its prompts were built from; () for free


def workload(name: str) -> Workload:
    if name == "free":
        return Workload("free", PROMPTS, ())
    if name == "edit":
        return _built(name, EDIT_SOURCES, edit_prompt)
    if name == "score":
        return _built(name, SCORE_SOURCES, score_prompt)
    raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")


def edit_prompt(qualified: str, source: str) -> str:
    """A function and the request to rename it: the answer is the function again, its name changed."""
    module, name = qualified.split(":")
    return (
        f"Below is the function `{name}` from the Python module `{module}`. Rewrite it with the function renamed to "
        f"`{name}_v2`, changing nothing else.\n\n```python\n{source.rstrip()}\n```\n\nThe rewritten function:\n\n"
        "```python\n"
    )


def score_prompt(qualified: str, doc: str) -> str:
    """A passage of documentation and a question answered by quoting it."""
    module, name = qualified.split(":")
    return (
        f"Documentation of `{name}` in the Python module `{module}`:\n\n{doc.strip()}\n\n"
        f"Question: what is `{name}` for, and how is it used? Answer by quoting the documentation above word for "
        'word.\n\nAnswer: "'
    )


def _built(name: str, sources: tuple[str, ...], make: Callable[[str, str], str]) -> Workload:
    prompts, used = [], []
    for qualified in sources:
        text = _text_of(qualified, source=name == "edit")
        if text is None:
            continue
        prompts.append(make(qualified, text))
        used.append(qualified)
    if not prompts:
        raise RuntimeError(f"none of the {name} workload's sources is installed: {', '.join(sources)}")
    return Workload(name, tuple(prompts), tuple(used))


def _text_of(qualified: str, source: bool) -> str | None:
    """The source (or the docstring) of `module:name`, or None where this installation does not have it."""
    module_name, name = qualified.split(":")
    try:
        obj = getattr(importlib.import_module(module_name), name)
        return inspect.getsource(obj) if source else inspect.getdoc(obj)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
