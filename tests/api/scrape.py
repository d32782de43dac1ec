"""Reading a /metrics scrape in the tests: every sample by name and labels, parsed by prometheus_client's own parser."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `name{labels}`; a KeyError names what is missing, so a misspelt name cannot pass as zero."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels} in the scrape")
    return samples[key]


def scrape(client: Any, headers: dict[str, str] | None = None) -> Samples:
    """GET /metrics with a TestClient (or anything with its `get`), checked to be 200."""
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    return parse(response.text)
