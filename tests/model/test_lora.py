"""LoRA adapters compute what `transformers` + `peft` compute with the adapter merged, in float32, for every family:
from a PEFT directory and from the GGUF LoRA llama.cpp's converter writes; alone, and in one step beside another
adapter and a request with none, which is left exactly as it is without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from tests.model.families import BY_NAME, FAMILIES, SIZES, write_gguf, write_hf_model
from tests.model.lora_adapters import make_adapter, write_gguf_lora
from tests.tiny_model import write_tiny_gguf, write_tiny_model
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampling import SamplingParams
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.lora import read_adapter
from tokenmill.server.load import load_engine_core

NAMES = ["gemma3", *(f.name for f in FAMILIES)]
IDS = torch.randint(3, SIZES["vocab_size"], (20,), generator=torch.Generator().manual_seed(4))
PROMPT = [2, *IDS[:9].tolist()]  # BOS first, as the tiny tokenizer starts every text
EOS = [1, 6]  # the tiny tokenizer's generation_config
TOP = 4  # log-probabilities compared at each generated token, best first
ALPHA = 8.0


class Case(NamedTuple):
    family: str
    arch: str  # its GGUF architecture
    directory: Path  # the base model, a Hugging Face directory
    base: torch.nn.Module  # transformers' model
    merged: dict[str, torch.nn.Module]  # adapter name → transformers' model with it merged
    adapters: dict[str, Path]  # adapter name → its file: `peft` a PEFT directory, `gguf` a GGUF LoRA
    cache: Path


@pytest.fixture(scope="module", params=NAMES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    import transformers

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        write_tiny_model(root / "hf")
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager").float()
        arch = "gemma3"
    else:
        base = write_hf_model(root / "hf", BY_NAME[request.param])
        arch = BY_NAME[request.param].gguf_arch
    merged = {
        "peft": make_adapter(base, request.param, root / "peft", seed=1),
        "gguf": make_adapter(base, request.param, root / "for-gguf", seed=2, rank=8, alpha=ALPHA),
    }
    gguf_file = write_gguf_lora(root / "adapter.gguf", root / "for-gguf", arch, ALPHA)
    return Case(request.param, arch, root / "hf", base.eval(), merged, {"peft": root / "peft", "gguf": gguf_file}, root)


def core_for(
    case: Case, adapters: dict[str, Path], dtype: str = "float32", model: Path | None = None, **settings: Any
) -> EngineCore:
    quantization = settings.pop("quantization", "none" if dtype == "float32" else None)
    lora = tuple(f"{name}={path}" for name, path in adapters.items())
    config = Config(
        model=str(model or case.directory),
        cache_dir=str(case.cache / "cache"),
        dtype=dtype,
        quantization=quantization,
        lora=lora,
        allow_runtime_lora=True,
        kv_cache_ram_gb=0,
        **settings,
    )
    return load_engine_core(config).core


def reference_greedy(model: torch.nn.Module, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from PROMPT, and at each the TOP best log-probabilities (T, TOP)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
        out = out[: next((i for i, t in enumerate(out) if t in EOS), len(out))]
        logits = model(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1]
    return out, torch.log_softmax(logits, -1).topk(TOP).values


def run_together(
    core: EngineCore, adapters: list[str | None], max_tokens: int = 8
) -> list[tuple[list[int], list[list[float]]]]:
    """The requests added at once (so their rows share every step), greedy, run to their ends on `core`: each one's
    tokens and, at each, the TOP best log-probabilities."""
    for i, adapter in enumerate(adapters):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=TOP, adapter=adapter, stop_token_ids=(6,)
        )
        core.add_request(f"r{i}", PROMPT, params)
    got: dict[str, tuple[list[int], list[list[float]]]] = {f"r{i}": ([], []) for i in range(len(adapters))}
    for _ in range(10 * max_tokens):
        for out in core.step():
            assert out.error is None, out.error
            for delta in out.deltas:
                got[out.request_id][0].extend(delta.token_ids)
                got[out.request_id][1].extend([logprob for _, _, logprob in lp.top] for lp in delta.logprobs or [])
        if not core.has_work:
            break
    assert not core.has_work
    return [got[f"r{i}"] for i in range(len(adapters))]


def test_adapter_files_read_alike(case: Case) -> None:
    """The GGUF LoRA holds the same update as the PEFT directory it was converted from (names, permutation, scale)."""
    model_config = load_model_files(str(case.directory), str(case.cache / "cache"), torch.float32, "none").config
    peft_file = read_adapter(str(case.cache / "for-gguf"), model_config)
    gguf_file = read_adapter(str(case.adapters["gguf"]), model_config)
    assert sorted(peft_file.modules) == sorted(gguf_file.modules) and peft_file.modules
    for name, update in peft_file.modules.items():
        other = gguf_file.modules[name]
        torch.testing.assert_close(other.b @ other.a * other.scale, update.b @ update.a * update.scale)


def test_mixed_steps_equal_peft_merged_and_leave_the_base_alone(case: Case) -> None:
    core = core_for(case, case.adapters)
    together = run_together(core, ["peft", None, "gguf"])
    for (tokens, logprobs), model in zip(together, [case.merged["peft"], case.base, case.merged["gguf"]]):
        expected_tokens, expected_logprobs = reference_greedy(model, 8)
        assert tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(logprobs), expected_logprobs, atol=1e-3, rtol=0)
    assert together[0][1] != together[1][1] and together[2][1] != together[1][1]  # the adapters changed something
    (alone,) = run_together(core_for(case, {}), [None])
    assert together[1] == alone  # bit for bit: the adapters beside it changed nothing
    assert run_together(core, ["gguf"]) == [together[2]]  # an adapter's rows too, alone or beside others


def test_bf16_gguf_base_rows_keep_their_c_path_beside_adapters(tmp_path: Path) -> None:
    """On the serving path (bf16 activations, a GGUF file's blocks, the C layers) a request without an adapter gives
    the same bits beside adapter rows as on a server with no adapters, and the adapter's rows follow the float32
    engine's on the same file."""
    import transformers

    write_tiny_model(tmp_path / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    make_adapter(base, "gemma3", tmp_path / "peft", seed=1)
    gguf_model = write_tiny_gguf(tmp_path / "tiny.gguf", quantize=True)
    case = Case("gemma3", "gemma3", tmp_path / "hf", base, {}, {}, tmp_path)
    core = core_for(case, {"tuned": tmp_path / "peft"}, dtype="bfloat16", model=gguf_model)
    assert core.runner.model.layers_in_c(torch.bfloat16)
    assert core.adapters is not None
    core.adapters.slots.rows.set([(0, 1), (None, 1)])
    assert core.adapters.slots.c_step() is not None  # the adapter's rows run in the layers' C call too (lora.c)
    core.adapters.slots.rows.clear()
    tuned, plain = run_together(core, ["tuned", None], max_tokens=6)
    (alone,) = run_together(core_for(case, {}, dtype="bfloat16", model=gguf_model), [None], max_tokens=6)
    assert plain == alone
    (exact,) = run_together(core_for(case, {"tuned": tmp_path / "peft"}, model=gguf_model), ["tuned"], max_tokens=6)
    assert tuned[0][:3] == exact[0][:3]  # bf16 activations: close, not equal
    assert (torch.tensor(tuned[1][:3]) - torch.tensor(exact[1][:3])).abs().max() < 0.1
    assert tuned[1] != plain[1]


def test_a_prompts_adapted_rows_are_the_same_in_small_steps_and_large(tmp_path: Path) -> None:
    """A gated MLP's adapted rows take one pass in a step of few rows and two in a step of many (decoder_layer.c's
    LORA_FUSED_ROWS): the same bits, so a row's numbers never depend on how many rows shared its step."""
    import transformers

    write_tiny_model(tmp_path / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    make_adapter(base, "gemma3", tmp_path / "peft", seed=1, merge=False)
    gguf_model = write_tiny_gguf(tmp_path / "tiny.gguf", quantize=True, max_position_embeddings=512)
    case = Case("gemma3", "gemma3", tmp_path / "hf", base, {}, {}, tmp_path)
    prompt = [2, *torch.randint(3, SIZES["vocab_size"], (119,), generator=torch.Generator().manual_seed(5)).tolist()]
    scored = []
    for budget in (512, 16):  # the prompt in one step of 120 rows, then in steps of 16
        core = core_for(case, {"tuned": tmp_path / "peft"}, "bfloat16", gguf_model, max_num_batched_tokens=budget)
        core.add_request("r", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, adapter="tuned"))
        outputs = [out for _ in range(20) for out in core.step()]
        scored.append([entry.logprob for out in outputs for entry in out.prompt_logprobs or []])
    assert len(scored[0]) == len(prompt) and scored[0] == scored[1]


def test_kv_made_under_an_adapter_is_never_another_requests(case: Case) -> None:
    """The prefix cache keys a block on the adapter too: the same prompt under another adapter (or none) finds
    nothing cached; under the same one again, its blocks."""
    core = core_for(case, case.adapters)
    cached = []
    for i, adapter in enumerate(["peft", None, "gguf", "peft"]):
        core.add_request(f"r{i}", PROMPT * 4, SamplingParams(max_tokens=1, adapter=adapter))
        for _ in range(20):
            cached += [out.num_cached_tokens for out in core.step() if out.finished]
            if not core.has_work:
                break
    assert cached[:3] == [0, 0, 0] and cached[3] > 0


def test_a_replica_reports_an_adapters_blocks_as_the_router_keys_them(case: Case) -> None:
    """What a replica tells the router of a request served under an adapter: the adapter's digest, from which the
    router keys that request's blocks (cluster/router.py) to the very keys the engine cached them under."""
    import asyncio
    from types import SimpleNamespace

    from tokenmill.cluster.replica import EngineReplica
    from tokenmill.cluster.router import ADAPTER_DIGESTS, HELD_BLOCKS, block_keys
    from tokenmill.engine.engine import AsyncEngine

    if case.family != "gemma3":
        pytest.skip("the keys do not hang on the family: one is enough")
    core = core_for(case, case.adapters)
    prompt = PROMPT * 4

    async def serve_one() -> dict[str, Any]:
        engine = AsyncEngine(core, "tiny", "fp_tiny")
        await engine.start()
        try:
            async for _ in engine.generate("r", prompt, SamplingParams(max_tokens=1, adapter="peft")):
                pass
            return await EngineReplica.record_routing_stats(SimpleNamespace(engine=engine))  # type: ignore[arg-type]
        finally:
            await engine.stop()

    stats = asyncio.run(asyncio.wait_for(serve_one(), timeout=120))
    digests = stats[ADAPTER_DIGESTS]
    assert set(digests) == {"peft", "gguf"} and digests["peft"] != digests["gguf"]
    size = core.blocks.block_size
    under_it = block_keys(prompt + [3], None, size, adapter=digests["peft"])
    assert len(under_it) == len(prompt) // size and set(under_it) <= set(stats[HELD_BLOCKS])
    assert not set(block_keys(prompt + [3], None, size)) & set(stats[HELD_BLOCKS])  # no adapter: other keys
    assert not set(block_keys(prompt + [3], None, size, adapter=digests["gguf"])) & set(stats[HELD_BLOCKS])


def test_a_gguf_file_in_int8_serves_adapters_and_caches_its_weights_without_them(tmp_path: Path) -> None:
    """A GGUF file served in int8 is quantised at its first start and the prepared weights cached: with adapters the
    linears are wrapped, yet the cache holds the model's own names, so the next start reads it."""
    base = write_hf_model(tmp_path / "hf", BY_NAME["llama"])
    make_adapter(base, "llama", tmp_path / "peft", seed=1, merge=False)
    path = write_gguf(tmp_path / "llama.gguf", BY_NAME["llama"], base)
    case = Case("llama", "llama", tmp_path / "hf", base, {}, {}, tmp_path)
    adapters = {"tuned": tmp_path / "peft"}
    first = run_together(core_for(case, adapters, "bfloat16", path, quantization="int8"), ["tuned", None])
    (cached,) = (tmp_path / "cache").rglob("prepared-v*.safetensors")
    assert not [key for key in load_file(str(cached)) if ".base." in key]
    again = run_together(core_for(case, adapters, "bfloat16", path, quantization="int8"), ["tuned", None])
    assert again == first and first[0] != first[1]


def test_adapted_steps_give_the_same_bits_in_the_modules_as_in_the_c_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from tokenmill.model.c_layer import CLayer, LayerStack

    write_tiny_model(tmp_path / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    make_adapter(base, "gemma3", tmp_path / "peft", seed=1, merge=False)
    gguf_model = write_tiny_gguf(tmp_path / "tiny.gguf", quantize=True)
    case = Case("gemma3", "gemma3", tmp_path / "hf", base, {}, {}, tmp_path)
    in_c = run_together(core_for(case, {"tuned": tmp_path / "peft"}, "bfloat16", gguf_model), ["tuned", None])
    monkeypatch.setattr(CLayer, "c_layer", False)
    monkeypatch.setattr(LayerStack, "enabled", False)
    modules = core_for(case, {"tuned": tmp_path / "peft"}, "bfloat16", gguf_model)
    assert not modules.runner.model.layers_in_c(torch.bfloat16)
    assert run_together(modules, ["tuned", None]) == in_c
