from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.report import format_table, format_value, notes_for, ratios, rows, write_json


def test_ratios_divide_the_first_system_by_each_other_where_both_have_the_figure() -> None:
    systems = {
        "tokenmill": {"decode_tok_s": 80.0, "c16_agg_tok_s": 400.0, "peak_rss_mb": 900.0, "startup_first_s": 9.0},
        "llama-cpp-python": {"decode_tok_s": 64.0, "c16_agg_tok_s": 50.0, "peak_rss_mb": None},
        "hf-bf16": {"decode_tok_s": 16.0},
    }
    out = ratios(systems)
    assert out["tokenmill/llama-cpp-python"] == {"decode_tok_s": pytest.approx(1.25), "c16_agg_tok_s": 8.0}
    assert out["tokenmill/hf-bf16"] == {"decode_tok_s": 5.0}
    assert ratios({"server": {"decode_tok_s": 1.0}}) == {}


def test_a_ratio_over_zero_or_missing_is_none() -> None:
    assert ratios({"a": {"x": 1.0, "y": None}, "b": {"x": 0.0, "y": 2.0}}) == {"a/b": {"x": None, "y": None}}


def test_table_has_a_column_per_system_and_ratio_and_skips_empty_rows() -> None:
    systems = {
        "tokenmill": {"decode_tok_s": 80.0, "ttft_s": 0.05, "c4_agg_tok_s": 200.0},
        "peer": {"decode_tok_s": 64.0, "ttft_s": 0.1, "c4_agg_tok_s": None},
    }
    lines = format_table(systems, [1, 4]).splitlines()
    assert lines[0].split() == ["figure", "unit", "tokenmill", "peer", "tokenmill/peer"]
    decode = next(line for line in lines if line.startswith("single-stream decode"))
    assert decode.split()[-3:] == ["80.0", "64.0", "1.25×"]
    ttft = next(line for line in lines if line.startswith("single-stream TTFT"))
    assert ttft.split()[-3:] == ["50", "100", "0.50×"]
    aggregate = next(line for line in lines if line.startswith("4 clients: aggregate"))
    assert aggregate.split()[-2:] == ["–", "–"]
    assert not any(line.startswith("1 client:") for line in lines)  # no system has 1-client figures


def test_rows_follow_the_concurrency_levels() -> None:
    keys = [key for key, _, _ in rows([1, 16])]
    assert keys[:4] == ["decode_tok_s", "bandwidth_share", "weights_read_mb", "ttft_s"]
    assert "c1_agg_tok_s" in keys and "c16_ttft_p99_s" in keys and keys[-1] == "startup_s"


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [(None, "s", "–"), (0.0512, "ms", "51"), (1.234, "s", "1.23"), (63.04, "tok/s", "63.0"), (1234.5, "MB", "1234")],
)
def test_values_are_formatted_per_unit(value: float | None, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


def test_notes_explain_ratios_and_the_transformers_columns() -> None:
    assert notes_for({"server": {}}) == []
    assert len(notes_for({"tokenmill": {}, "hf-bf16": {}})) == 2


def test_json_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    write_json(path, {"figures": {"tokenmill": {"decode_tok_s": 1.5, "x": None}}})
    assert json.loads(path.read_text()) == {"figures": {"tokenmill": {"decode_tok_s": 1.5, "x": None}}}
