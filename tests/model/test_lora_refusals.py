"""What an adapter may not be, each refused with one line that says what and where; and adapters unloaded while a
request still runs with one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.families import BY_NAME, write_hf_model
from tests.model.lora_adapters import make_adapter, write_gguf_lora
from tokenmill.config import Config
from tokenmill.engine.sampling import SamplingParams
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.lora import AdapterError, read_adapter
from tokenmill.server.load import ModelLoadError, load_engine_core

PROMPT = [2, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("llama")
    return root, write_hf_model(root / "hf", BY_NAME["llama"])


def serve(root: Path, model: Path, **settings: Any) -> Any:
    config = Config(model=str(model), cache_dir=str(root / "cache"), dtype="float32", kv_cache_ram_gb=0, **settings)
    return load_engine_core(config).core


def one_line(message: str) -> str:
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"lora_bias": True}, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_what_changes_more_than_the_linears_is_refused(
    llama: tuple[Path, torch.nn.Module], tmp_path: Path, options: dict[str, Any], said: str
) -> None:
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1, merge=False, **options)
    config = load_model_files(str(root / "hf"), str(root / "cache"), torch.float32).config
    with pytest.raises(AdapterError) as refused:
        read_adapter(str(tmp_path / "adapter"), config)
    assert said in one_line(str(refused.value))


def test_an_embedding_update_is_refused(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1, merge=False, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ModelLoadError) as refused:
        serve(root, root / "hf", lora=(f"a={tmp_path / 'adapter'}",))
    assert "embed_tokens" in one_line(str(refused.value))


def test_an_adapter_for_another_base_names_both(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """Llama's adapter on Qwen3 (another head size): its q_proj's shape, the adapter's and the model's."""
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1)
    write_hf_model(tmp_path / "qwen3", BY_NAME["qwen3"])
    with pytest.raises(ModelLoadError) as refused:
        serve(root, tmp_path / "qwen3", lora=(f"a={tmp_path / 'adapter'}",))
    message = one_line(str(refused.value))
    assert (
        "does not fit qwen3 (qwen3)" in message and "k_proj is 64 → 32 in the adapter, 64 → 48 in the model" in message
    )


def test_a_gguf_lora_of_another_architecture_names_both(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1)
    gguf_lora = write_gguf_lora(tmp_path / "a.gguf", tmp_path / "adapter", "llama", 8.0)
    write_hf_model(tmp_path / "qwen2", BY_NAME["qwen2"])
    with pytest.raises(ModelLoadError) as refused:
        serve(root, tmp_path / "qwen2", lora=(f"a={gguf_lora}",))
    assert "built for a llama model; the model served is qwen2" in one_line(str(refused.value))


def test_limits_and_formats(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1, rank=8)
    with pytest.raises(ModelLoadError, match="rank 8, above --max-lora-rank 4"):
        serve(root, root / "hf", lora=(f"a={tmp_path / 'adapter'}",), max_lora_rank=4)
    (tmp_path / "adapter" / "adapter_model.safetensors").rename(tmp_path / "adapter" / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        serve(root, root / "hf", lora=(f"a={tmp_path / 'adapter'}",))
    with pytest.raises(ModelLoadError, match="no LoRA adapter at"):
        serve(root, root / "hf", lora=(f"a={tmp_path / 'nowhere'}",))


def test_rslora_scales_by_the_square_root_of_the_rank(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, base = llama
    merged = make_adapter(base, "llama", tmp_path / "adapter", seed=1, rank=16, use_rslora=True)
    assert merged is not None
    core = serve(root, root / "hf", lora=(f"a={tmp_path / 'adapter'}",))
    model = core.runner.model
    ids = torch.tensor(PROMPT)
    model.adapters.rows.set([(0, len(PROMPT))])
    with torch.no_grad():
        expected = merged(ids[None]).logits[0]
    torch.testing.assert_close(model.forward_dense(ids), expected, atol=1e-3, rtol=0)


def test_a_request_for_an_adapter_not_loaded_fails_alone(llama: tuple[Path, torch.nn.Module]) -> None:
    root, _ = llama
    core = serve(root, root / "hf", allow_runtime_lora=True)
    core.add_request("bad", PROMPT, SamplingParams(max_tokens=2, adapter="nope"))
    core.add_request("good", PROMPT, SamplingParams(max_tokens=2))
    outputs = {out.request_id: out for _ in range(5) for out in core.step()}
    assert "no LoRA adapter named 'nope'" in (outputs["bad"].error or "")
    assert outputs["good"].error is None


def test_unloading_waits_for_the_requests_running_with_it(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, base = llama
    make_adapter(base, "llama", tmp_path / "adapter", seed=1)
    core = serve(root, root / "hf", lora=(f"a={tmp_path / 'adapter'}",))
    wrappers = core.adapters.slots.wrappers()
    core.add_request("running", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    core.add_request("adapted", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, adapter="a", ignore_eos=True))
    core.step()
    core.unload_adapter("a")
    assert core.loaded_adapters() == [] and all(0 in w.updates for w in wrappers)  # still in use
    core.add_request("late", PROMPT, SamplingParams(max_tokens=1, adapter="a"))
    errors = {}
    for _ in range(20):
        errors.update({out.request_id: out.error for out in core.step() if out.finished})
        if not core.has_work:
            break
    assert errors == {"running": None, "adapted": None, "late": errors["late"]} and "no LoRA adapter" in errors["late"]
    core.step()
    assert all(0 not in w.updates for w in wrappers)  # dropped once nothing used them
    core.load_adapter("b", str(tmp_path / "adapter"))
    assert [a.slot for a in core.loaded_adapters()] == [0]
