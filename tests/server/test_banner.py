"""The start-up banner, and a real `tokenmill serve --log-format json`: its banner, our access lines in place of
uvicorn's, and every line of its log a JSON object."""

from __future__ import annotations

import json
import shlex
import signal
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.api.api_helpers import tiny_engine
from tests.api.fake_engine import FakeEngine
from tests.api.server_process import serve
from tests.model.families import BY_NAME, write_gguf, write_hf_model
from tests.model.gguf_blocks import MIXED
from tests.tiny_model import write_tiny_gguf
from tokenmill.config import Config
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.outputs import EngineDescription
from tokenmill.kernels import ops
from tokenmill.server.banner import banner, url_of
from tokenmill.server.load import load_engine_core

DESCRIPTION = EngineDescription("bfloat16", "gguf", 4096, ("fused", "gguf_matmul"), 1 << 30, "/var/kv/ab12", 5 << 30)
KEY = "sk-banner-secret"


def test_the_banner_names_the_url_each_model_and_what_it_runs_on() -> None:
    described = tiny_engine()
    described.description = DESCRIPTION
    text, fields = banner("http://127.0.0.1:8000", [described, FakeEngine()], with_key=False)
    lines = text.splitlines()
    assert lines[0] == "tokenmill is serving on http://127.0.0.1:8000"
    assert lines[1] == (
        "  tiny: bfloat16; gguf weights; context 512 tokens; KV cache 4096 tokens;"
        " prefix cache tiers: RAM 1.0 GiB, disk 5.0 GiB in /var/kv/ab12; C kernels: fused, gguf_matmul"
    )
    assert lines[2] == "  fake-model: context 128 tokens"  # an engine that does not describe itself
    assert [m["model"] for m in fields["models"]] == ["tiny", "fake-model"]
    assert fields["models"][0]["kv_cache_tokens"] == 4096


def test_the_curl_line_runs_as_pasted_and_shows_key_only_as_a_variable() -> None:
    engine = tiny_engine()
    engine.description = replace(DESCRIPTION, quantization="none", kernels=())
    for with_key in (False, True):
        text, fields = banner("http://[::1]:9000", [engine], with_key=with_key)
        words = shlex.split(fields["curl"])
        assert words[:2] == ["curl", "http://[::1]:9000/v1/completions"]
        assert json.loads(words[words.index("-d") + 1])["model"] == "tiny"
        assert ("Authorization: Bearer $KEY" in words) == with_key
        assert text.splitlines()[-1] == f"  try: {fields['curl']}"
    assert "unquantised weights" in text and "C kernels: none (torch only)" in text


def _gguf(family: str, tmp_path: Path) -> Path:
    if family == "gemma3":
        return write_tiny_gguf(tmp_path / "gemma3.gguf", quantize=MIXED)
    hf = write_hf_model(tmp_path / family, BY_NAME[family])
    return write_gguf(tmp_path / f"{family}.gguf", BY_NAME[family], hf, quantize=MIXED)


@pytest.mark.skipif(not ops.decoder_layer_available(), reason="the C decoder layer is not built here")
@pytest.mark.parametrize(
    ("family", "activation"), [("llama", "silu_mul"), ("qwen2", "silu_mul"), ("gemma3", "gelu_mul")]
)
def test_the_banner_names_the_decoder_layer_kernel_of_a_gguf_model_whose_layers_all_run_in_it(
    family: str, activation: str, tmp_path: Path
) -> None:
    config = Config(model=str(_gguf(family, tmp_path)), cache_dir=str(tmp_path / "cache"), num_kv_blocks=16)
    loaded = load_engine_core(config)
    assert loaded.core.runner.model.layers_in_c(loaded.core.runner.dtype)
    engine = AsyncEngine(loaded.core, loaded.model_name, loaded.system_fingerprint, description=loaded.description)
    line = banner("http://127.0.0.1:8000", [engine], with_key=False)[0].splitlines()[1]
    kernels = line.split("C kernels: ")[1].split(", ")
    assert "decoder_layer" in kernels and activation in kernels and "gguf_matmul" in kernels
    other = "gelu_mul" if activation == "silu_mul" else "silu_mul"
    assert other not in kernels  # the activation the model calls, not another family's


def test_an_ipv6_host_is_bracketed_in_the_url() -> None:
    assert url_of("::", 8000) == "http://[::]:8000" and url_of("127.0.0.1", 0) == "http://127.0.0.1:0"


def test_a_json_server_log_is_all_json_with_the_banner_and_our_access_lines(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    flags = ("--log-format", "json", "--api-key", KEY, "--kv-cache-mb", "1")
    with serve(tiny_model_dir, tmp_path, *flags) as server:
        auth = {"Authorization": f"Bearer {KEY}", "x-request-id": "probe-1"}
        payload = {"model": tiny_model_dir.name, "prompt": "hello", "max_tokens": 3}
        ok = httpx.post(server.base_url + "/v1/completions", json=payload, headers=auth, timeout=60)
        missing = httpx.get(server.base_url + "/nope", headers=auth, timeout=60)
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0
    raw = server.log.read_text()
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    assert ok.status_code == 200 and missing.status_code == 404
    (start,) = [line for line in lines if line["logger"] == "tokenmill.banner"]
    assert start["url"] == server.base_url and start["models"][0]["model"] == tiny_model_dir.name
    assert start["models"][0]["kv_cache_tokens"] > 0 and '"Authorization: Bearer $KEY"' in start["curl"]
    access = [line for line in lines if line["logger"] == "tokenmill.access" and line["path"] != "/health"]
    assert [(a["request_id"], a["status"]) for a in access] == [("probe-1", 200), ("probe-1", 404)]
    assert access[0]["completion_tokens"] == ok.json()["usage"]["completion_tokens"]
    assert not [line for line in lines if line["logger"] == "uvicorn.access"]
    assert any(line["logger"] == "uvicorn.error" for line in lines)  # uvicorn's own lines come out as JSON too
    assert KEY not in raw and "hello" not in raw
