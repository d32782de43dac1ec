"""A Gemma 3 or Llama-family layer on the file's GGUF blocks in one C call (kernels/decoder_layer.c) computes what
the modules compute, bit for bit: prefill, chunked prefill beside decodes, sliding windows, the paged cache it writes,
Qwen2's q/k/v biases, Phi-3's fused projections."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.engine.tiny import run_all, tiny_model
from tests.model.families import BY_NAME, write_gguf, write_hf_model
from tests.model.gguf_blocks import IDS, MIXED, native_model
from tests.tiny_model import tiny_tokenizer, write_tiny_gguf
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.kernels import ops
from tokenmill.model.c_layer import LayerStack
from tokenmill.model.gemma3 import Gemma3DecoderLayer
from tokenmill.model.llama import LlamaDecoderLayer
from tokenmill.server.description import describe
from tokenmill.server.engine_core import build_engine_core

pytestmark = pytest.mark.skipif(
    ops.library() is None or not ops.decoder_layer_available(), reason="the C decoder layer is not built here"
)

PROMPTS = [[2, 5, 9], [2, *range(4, 30)], [2, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [2, 11]]  # one past the chunk budget


def test_every_layer_of_a_gguf_model_takes_the_c_path_and_its_logits_equal_the_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = native_model(write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    assert all(isinstance(layer, Gemma3DecoderLayer) and layer.c_plan() is not None for layer in model.model.layers)
    in_c = model.forward_dense(IDS)
    monkeypatch.setattr(Gemma3DecoderLayer, "c_layer", False)
    assert torch.equal(model.forward_dense(IDS), in_c)


def _greedy_run(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> dict[str, list[object]]:
    """Four requests at once through the engine: chunked prefill beside decodes, prompts past the sliding window.
    Plain steps: drafts follow timed step costs, so two runs of the paths compared here would take different steps."""
    config = Config(
        dtype="bfloat16",
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        speculative="off",
        kv_cache_dtype=kv_cache_dtype,
    )
    core = build_engine_core(model, tiny_tokenizer(), config)  # type: ignore[arg-type]
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True))
    return {rid: _tokens_and_logprobs(outs) for rid, outs in run_all(core).items()}


def _tokens_and_logprobs(outs: list[RequestOutput]) -> list[object]:
    """A request's outputs as what the comparisons check: each token, with its logprob and top; not how the tokens
    fell into deltas (a step that keeps a draft gives several at once)."""
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    logprobs = [(t.logprob, t.top) for o in outs for d in o.deltas for t in d.logprobs or []]
    return [tokens, logprobs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_steps_in_c_equal_the_modules_token_for_token_and_logprob_for_logprob(
    kv_cache_dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    in_c = _greedy_run(native_model(path, tmp_path / "cache"), kv_cache_dtype)
    monkeypatch.setattr(Gemma3DecoderLayer, "c_layer", False)
    modules = _greedy_run(native_model(path, tmp_path / "cache"), kv_cache_dtype)
    assert sum(len(tokens) for tokens, _ in in_c.values()) == 12 * len(PROMPTS)
    assert in_c == modules


def test_an_8bit_cache_gives_each_request_its_own_numbers_alone_or_batched_close_to_16_bits(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    batched = _greedy_run(native_model(path, tmp_path / "cache"), "int8")
    for i, prompt in enumerate(PROMPTS):
        config = Config(dtype="bfloat16", block_size=4, num_kv_blocks=128, speculative="off", kv_cache_dtype="int8")
        core = build_engine_core(native_model(path, tmp_path / "cache"), tiny_tokenizer(), config)  # type: ignore[arg-type]
        core.add_request("alone", prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True))
        assert _tokens_and_logprobs(run_all(core)["alone"]) == batched[f"r{i}"]
    bf16 = _greedy_run(native_model(path, tmp_path / "cache"))
    first = [(batched[r][1][0][0], bf16[r][1][0][0]) for r in bf16]  # each request's first logprob, 8 and 16 bits
    assert all(abs(a - b) < 0.05 for a, b in first), first


def _counting_stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers of each decoder_forward call (a step from its ids in one call)."""
    calls: list[int] = []
    real = ops.decoder_forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(len(args[2]))  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "decoder_forward", counted)
    return calls


@pytest.mark.parametrize("name", ["gemma3", "llama", "qwen2"])
def test_a_steps_layers_run_as_one_c_call_with_the_bits_of_a_call_per_layer(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's sliding and global layers (two kinds of rope and key lists in one call), Llama's one kind."""
    path = (
        write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED) if name == "gemma3" else _family_gguf(tmp_path, name)
    )
    calls = _counting_stack_calls(monkeypatch)
    model = _one_global_layer(native_model(path, tmp_path / "cache"))
    stacked, stacked_dense = _greedy_run(model), model.forward_dense(IDS)
    assert calls and set(calls) == {len(model.model.layers)}  # every step, every layer
    monkeypatch.setattr(LayerStack, "enabled", False)
    calls.clear()
    assert _greedy_run(_one_global_layer(native_model(path, tmp_path / "cache"))) == stacked
    assert torch.equal(model.forward_dense(IDS), stacked_dense)
    assert not calls


def _one_global_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The tiny Gemma 3 file's layers are all sliding (every sixth is global): its second made global, as in a real
    file, so that a step holds both kinds (the local rope and the window, the global rope and the whole context)."""
    layer = model.model.layers[1]  # type: ignore[union-attr, index]
    if isinstance(layer, Gemma3DecoderLayer):
        layer.is_sliding, layer.self_attn.window = False, None
        assert {layer.is_sliding for layer in model.model.layers} == {True, False}  # type: ignore[union-attr]
    return model


def test_a_layer_without_gguf_blocks_keeps_the_modules() -> None:
    model = tiny_model()
    assert all(isinstance(layer, Gemma3DecoderLayer) and layer.c_plan() is None for layer in model.model.layers)


def test_the_banner_names_the_c_layer_only_where_every_layer_takes_it(tmp_path: Path) -> None:
    config = Config(dtype="bfloat16", block_size=4, num_kv_blocks=32)
    gguf = native_model(write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    assert "decoder_layer" in describe(build_engine_core(gguf, tiny_tokenizer(), config), config).kernels  # type: ignore[arg-type]
    plain = build_engine_core(tiny_model().to(torch.bfloat16), tiny_tokenizer(), config)  # type: ignore[arg-type]
    assert "decoder_layer" not in describe(plain, config).kernels


LLAMA_FAMILIES = ["llama", "llama3", "mistral", "qwen2", "phi3"]


def _family_gguf(tmp_path: Path, name: str) -> Path:
    family = BY_NAME[name]
    return write_gguf(tmp_path / f"{name}.gguf", family, write_hf_model(tmp_path / name, family), quantize=MIXED)


@pytest.mark.parametrize("name", LLAMA_FAMILIES)
def test_every_llama_family_layer_takes_the_c_path_and_computes_what_the_modules_do(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _family_gguf(tmp_path, name)
    model = native_model(path, tmp_path / "cache")
    assert all(isinstance(layer, LlamaDecoderLayer) and layer.c_plan() is not None for layer in model.model.layers)
    in_c = model.forward_dense(IDS)
    in_c_run = _greedy_run(model)
    monkeypatch.setattr(LlamaDecoderLayer, "c_layer", False)
    assert torch.equal(model.forward_dense(IDS), in_c)
    assert _greedy_run(native_model(path, tmp_path / "cache")) == in_c_run


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_gate_and_up_of_one_type_take_the_gated_pass_with_the_modules_bits(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matrix of one type: gate and up are one part, and the layer multiplies and activates in one pass
    (gguf_matmul_gated: gelu for Gemma, silu for Llama), where the mixed files above take two."""
    if name == "gemma3":
        path, kind = write_tiny_gguf(tmp_path / "q5.gguf", quantize=[T.Q5_0]), Gemma3DecoderLayer
    else:
        family = BY_NAME[name]
        path = write_gguf(tmp_path / "q5.gguf", family, write_hf_model(tmp_path / name, family), quantize=[T.Q5_0])
        kind = LlamaDecoderLayer
    model = native_model(path, tmp_path / "cache")
    plans = [layer.c_plan() for layer in model.model.layers]
    assert all(plan is not None and plan.gate_up.parts == 1 for plan in plans)
    in_c = model.forward_dense(IDS)
    monkeypatch.setattr(kind, "c_layer", False)
    assert torch.equal(model.forward_dense(IDS), in_c)


def test_qwen3s_head_norms_keep_the_modules(tmp_path: Path) -> None:
    model = native_model(_family_gguf(tmp_path, "qwen3"), tmp_path / "cache")
    assert all(isinstance(layer, LlamaDecoderLayer) and layer.c_plan() is None for layer in model.model.layers)


@pytest.mark.parametrize("rows", [65, 129])
def test_a_prompts_last_token_in_a_step_of_64k_plus_1_rows_gets_its_own_numbers(rows: int, tmp_path: Path) -> None:
    """The GGUF matmul takes a step's rows 64 at a time. A step of 64k + 1 rows ends in a pass of one row: the step's
    last row, a prompt's last token, whose logits are sampled. That pass once read the first row's activations, and
    the seeded request of tests/e2e/test_seeds_under_load.py drew another first token whenever the server's batch
    happened to hold 65 rows. Here: four streams decoding, a long prompt and the target prompt in one step."""
    model = native_model(write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    target = [2, 5, 9, 14, 3, 7]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)

    def run(with_load: bool) -> tuple[list[object], list[int]]:
        config = Config(
            dtype="bfloat16",
            block_size=4,
            num_kv_blocks=256,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            speculative="off",
        )
        core = build_engine_core(model, tiny_tokenizer(), config)
        step_rows: list[int] = []
        core.step_observers.append(lambda report: step_rows.append(report.num_tokens))
        if with_load:
            for i in range(4):
                core.add_request(f"d{i}", [2, 20 + i], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            core.step()  # their prompts; from the next step on each decodes one row
            long_prompt = [2, *(30 + i % 200 for i in range(rows - 4 - len(target) - 1))]
            core.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
        core.add_request("t", target, params)
        return _tokens_and_logprobs(run_all(core)["t"]), step_rows

    alone, _ = run(with_load=False)
    loaded, step_rows = run(with_load=True)
    assert step_rows[1] == rows  # the decodes, the long prompt and the target's prompt, its last token the last row
    assert loaded == alone


BUDGETS = [24, 48, 65, 96, 129, 160, 193, 256]  # a step's token budget, one per round; some of them 64k + 1


def test_requests_arriving_at_random_steps_compute_what_they_compute_alone(tmp_path: Path) -> None:
    """Batch invariance over the step sizes a server makes: 24 seeded requests (prompts of 1-61 tokens, greedy and
    sampled) arriving in groups at random steps, in eight rounds under token budgets of 24-256, so that steps of a
    few rows to a couple of hundred mix prefills, chunked prefills and decodes. Each request's tokens and logprobs
    must be those it gets alone."""
    model = native_model(write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    rng = random.Random(0)
    requests = {
        f"r{i}": (
            [2, *rng.choices(range(4, 500), k=rng.randint(0, 60))],
            SamplingParams(
                max_tokens=rng.randint(1, 10),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randint(0, 99),
                logprobs=2,
                ignore_eos=True,
            ),
        )
        for i in range(24)
    }
    config = Config(dtype="bfloat16", block_size=4, num_kv_blocks=1024, max_num_seqs=16, max_num_prefills=6)

    def core_with_budget(budget: int) -> EngineCore:
        return build_engine_core(model, tiny_tokenizer(), config.with_overrides(max_num_batched_tokens=budget))

    alone = {}
    for request_id, (prompt, params) in requests.items():
        core = core_with_budget(256)
        core.add_request(request_id, prompt, params)
        alone[request_id] = _tokens_and_logprobs(run_all(core)[request_id])
    step_rows: list[int] = []
    for budget in BUDGETS:
        core = core_with_budget(budget)
        core.step_observers.append(lambda report: step_rows.append(report.num_tokens))
        arrivals = sorted((rng.randint(0, 8), request_id) for request_id in requests)
        outputs: dict[str, list[RequestOutput]] = {}
        for step in range(500):
            while arrivals and arrivals[0][0] <= step:
                request_id = arrivals.pop(0)[1]
                core.add_request(request_id, *requests[request_id])
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
            if not arrivals and not core.has_work:
                break
        assert {request_id: _tokens_and_logprobs(outs) for request_id, outs in outputs.items()} == alone, budget
    assert {65, 129} <= set(step_rows) and min(step_rows) < 8  # steps of 64k + 1 rows among many sizes


@pytest.mark.skipif(not ops.paged_attention_available(), reason="no native attention kernel here")
def test_a_long_context_decodes_the_same_alone_as_beside_others(tmp_path: Path) -> None:
    """Past ATTENTION_KEY_CHUNK keys the attention kernel takes a row's keys in chunks: a single stream's row has its
    chunks shared between the threads, a batch's rows each on one thread. Tokens and logprobs must not tell."""
    chunk = ops.ATTENTION_KEY_CHUNK
    context = 4 * chunk  # a window as long as the context: every layer sees all the keys
    path = write_tiny_gguf(
        tmp_path / "long.gguf", quantize=MIXED, max_position_embeddings=context, sliding_window=context
    )
    model = native_model(path, tmp_path / "cache")
    rng = random.Random(1)
    long_prompts = [[2, *rng.choices(range(4, 500), k=n)] for n in (chunk + 40, 2 * chunk + 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    config = Config(dtype="bfloat16", block_size=16, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=1024)
    alone = {}
    for i, prompt in enumerate(long_prompts):
        core = build_engine_core(model, tiny_tokenizer(), config)
        core.add_request(f"r{i}", prompt, params)
        alone[f"r{i}"] = _tokens_and_logprobs(run_all(core)[f"r{i}"])
    core = build_engine_core(model, tiny_tokenizer(), config)
    for i, prompt in enumerate(long_prompts):  # decoded side by side, beside short requests' prefills and decodes
        core.add_request(f"r{i}", prompt, params)
    for i in range(2):  # four rows a decode step: each row on one thread, where one or three share out their chunks
        core.add_request(f"short{i}", [2, 7 + i, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    together = {rid: _tokens_and_logprobs(outs) for rid, outs in run_all(core).items()}
    assert {rid: together[rid] for rid in alone} == alone


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_a_step_from_its_ids_grows_the_rotary_tables_and_keeps_the_modules_bits(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One C call from the token ids (the embedding's rows, Gemma's scale, the rotary rows, the final norm): a prompt
    past the rotary tables' first 256 positions, then a longer one, as the modules compute them."""
    path = (
        write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED) if name == "gemma3" else _family_gguf(tmp_path, name)
    )
    calls = _counting_stack_calls(monkeypatch)
    model = _one_global_layer(native_model(path, tmp_path / "cache"))
    ids = torch.tensor([2, *(4 + i * 7 % 40 for i in range(299))])
    short, long = model.forward_dense(ids), model.forward_dense(torch.cat([ids, ids[1:]]))
    assert len(calls) == 2
    monkeypatch.setattr(LayerStack, "enabled", False)
    assert torch.equal(model.forward_dense(ids), short)
    assert torch.equal(model.forward_dense(torch.cat([ids, ids[1:]])), long)


def test_a_token_id_outside_the_embedding_is_refused_not_read(tmp_path: Path) -> None:
    model = native_model(write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    rows = model.model.embed_tokens.get_buffer("raw").shape[0]  # type: ignore[operator]
    with pytest.raises(ValueError, match="token id or position outside"):
        model.forward_dense(torch.tensor([2, rows]))
    with pytest.raises(ValueError, match="token id or position outside"):
        model.forward_dense(torch.tensor([2, -1]))
    assert model.forward_dense(torch.tensor([2, rows - 1])).shape[0] == 2
