"""The transformers baseline on the tiny model (in-process here; the bench runs it in a subprocess)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.bench.hf_baseline import left_padded, measure


def test_left_padding_keeps_prompts_at_the_right_edge() -> None:
    ids, mask = left_padded([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_measure_reports_single_stream_and_batch_figures(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = measure("float32", str(tiny_model_dir), str(tmp_path), max_tokens=6, batch=3, runs=1)
    assert result["decode_tok_s"] > 0 and result["ttft_s"] > 0 and result["batch3_agg_tok_s"] > 0
    assert result["batch"] == 3 and result["peak_rss_mb"] > 0 and result["dtype"] == "float32"
