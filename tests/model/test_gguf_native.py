"""A GGUF model run on its own quantised blocks (`--quantization gguf`, the default for GGUF files)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.model.gguf_blocks import IDS, MIXED, activations, native_model, weights
from tests.tiny_model import write_tiny_gguf
from tokenmill.kernels import ops
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gguf_linear import GREEDY_REST, GgufEmbedding, GgufLinear, GgufWeight, Regrouping
from tokenmill.model.gguf_quant import dequantize, gguf_matmul
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model


def float_model(path: Path, cache: Path) -> CausalLM:
    """The same file dequantised to float32: the values the blocks stand for, exactly."""
    loaded = load_model_files(str(path), str(cache), torch.float32, "none")
    return build_model(loaded.config, loaded.state_dict)


def test_the_files_blocks_are_kept_and_nothing_is_cached(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    model = native_model(path, tmp_path / "cache")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GgufLinear) and sorted(qkv.types) == sorted(int(t) for t in MIXED)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, GgufLinear)
    assert isinstance(model.model.embed_tokens, GgufEmbedding) and isinstance(model.lm_head, GgufLinear)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("gguf-*"))  # no conversion


def test_logits_follow_the_dequantised_model(tmp_path: Path) -> None:
    """Only the activations' int8 rounding (per 32) and bf16 separate the two: same argmax, close logits."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    native = native_model(path, tmp_path / "cache").forward_dense(IDS)
    reference = float_model(path, tmp_path / "cache").forward_dense(IDS)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    assert (native - reference).norm() / reference.norm() < 0.05


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_the_torch_fallback_computes_what_the_kernel_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    with_kernel = native_model(path, tmp_path / "cache").forward_dense(IDS)
    monkeypatch.setattr(ops, "gguf_matmul_available", lambda: False)
    model = native_model(path, tmp_path / "cache")
    assert not model.model.layers[0].self_attn.qkv_proj.kernel
    without = model.forward_dense(IDS)
    assert torch.equal(without.argmax(-1), with_kernel.argmax(-1))
    assert (without - with_kernel).norm() / with_kernel.norm() < 0.02  # bf16 roundings fall differently


def test_float_matrices_in_the_file_get_the_int8_path(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "f32.gguf")  # no quantised tensor at all
    model = native_model(path, tmp_path / "cache")
    assert not any(isinstance(m, GgufLinear) for m in model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())  # all int8 now


def test_a_float32_input_is_multiplied_as_its_bfloat16_rounding() -> None:
    """The layer's parts are in the kernel's layout when it is built: any input dtype goes through it, never through
    the torch path (which reads the file's layout)."""
    raw, k = weights(T.Q5_0)
    layer = GgufLinear([GgufWeight(int(T.Q5_0), raw, k)])
    x = torch.randn(3, k)
    assert torch.equal(layer(x), layer(x.to(torch.bfloat16), out_dtype=torch.float32))
    assert torch.allclose(layer(x), gguf_matmul(x.to(torch.bfloat16), raw, int(T.Q5_0), k), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
@pytest.mark.parametrize(("first_rows", "calls"), [(32, 1), (24, 2)])
def test_parts_of_one_type_are_computed_as_one_only_where_the_first_fills_whole_groups(
    first_rows: int, calls: int
) -> None:
    """q and k of one type become one kernel call when q's rows fill whole 16-column groups (k's groups then follow
    q's in the regrouped layout); otherwise each keeps its own. Either way each column is what it is alone."""
    (q, k), (kk, _) = weights(T.Q8_0, n=first_rows), weights(T.Q8_0, n=16, seed=3)
    layer = GgufLinear([GgufWeight(int(T.Q8_0), q, k), GgufWeight(int(T.Q8_0), kk, k)])
    assert len(layer.kernel_parts()) == calls
    x = activations(3, k).to(torch.bfloat16)
    alone = [GgufLinear([GgufWeight(int(T.Q8_0), w, k)])(x) for w in (q, kk)]
    assert torch.equal(layer(x), torch.cat(alone, dim=1))


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_layers_sharing_a_regrouping_are_written_when_it_runs() -> None:
    regrouping = Regrouping()
    parts = [weights(t, seed=i) for i, t in enumerate((T.Q5_0, T.Q4_K, T.Q6_K))]
    layers = [
        GgufLinear([GgufWeight(int(t), raw, k)], regrouping) for (raw, k), t in zip(parts, (T.Q5_0, T.Q4_K, T.Q6_K))
    ]
    for layer in layers:
        for _, packed, _, _ in layer.kernel_parts():
            packed.fill_(0)  # what an unwritten buffer could hold
    regrouping.run()
    for layer, (raw, k), t in zip(layers, parts, (T.Q5_0, T.Q4_K, T.Q6_K)):
        x = activations(2, k).to(torch.bfloat16)
        assert torch.equal(layer(x), GgufLinear([GgufWeight(int(t), raw, k)])(x))


def _resident_kb(path: Path) -> int:
    """This process's resident KB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_a_file_backed_weight_leaves_the_process_once_regrouped(tmp_path: Path) -> None:
    """The file's pages read to regroup a weight are dropped from the process right after (they stay in the page
    cache), so the file's copy and the regrouped one are never both counted; a weight not from a file is kept."""
    raw, k = weights(T.Q8_0, n=1024)
    path = tmp_path / "blocks.bin"
    raw.numpy().tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c").reshape(raw.shape))
    assert int(mapped.sum()) == int(raw.sum()) and _resident_kb(path) >= raw.nbytes // 1024 - 4  # read in
    layer = GgufLinear([GgufWeight(int(T.Q8_0), mapped, k, file_backed=True)])
    assert _resident_kb(path) <= 8  # at most a page at either end
    x = activations(2, k).to(torch.bfloat16)
    assert torch.equal(layer(x), GgufLinear([GgufWeight(int(T.Q8_0), raw, k)])(x))
    assert torch.equal(mapped, raw)  # the mapping still reads the file


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_the_heads_own_pass_reports_each_rows_argmax_and_finiteness(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    model = native_model(path, tmp_path / "cache")
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    hidden[3] = float("nan")
    with torch.inference_mode():
        logits, summary = model.compute_logits_summarised(hidden)
        assert torch.allclose(logits, model.compute_logits(hidden), rtol=0, atol=0, equal_nan=True)  # the same bits
    assert summary is not None and summary.finite == [True, True, True, False, True]
    good = [0, 1, 2, 4]
    assert [summary.argmax[i] for i in good] == logits[good].argmax(dim=-1).tolist()


def test_a_head_without_the_kernels_pass_reports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch fallback, and a soft-capped head (the cap's tanh comes after the product), leave the checks to the
    sampler."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED)
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model = native_model(path, tmp_path / "cache")
    model.config = dataclasses.replace(model.config, final_logit_softcapping=30.0)
    with torch.inference_mode():
        assert model.compute_logits_summarised(hidden[:, : model.config.hidden_size])[1] is None
    monkeypatch.setattr(ops, "gguf_matmul_available", lambda: False)
    fallback = native_model(path, tmp_path / "cache")
    with torch.inference_mode():
        logits, summary = fallback.compute_logits_summarised(hidden[:, : fallback.config.hidden_size])
        lone, lone_summary = fallback.compute_logits_summarised(hidden[:1, : fallback.config.hidden_size], keep=[])
    assert summary is None and logits.shape == (2, fallback.config.vocab_size)
    assert lone_summary is None and torch.equal(lone, logits[:1])  # a lone greedy row: no copy here, the full row


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_after_a_row_the_copy_cannot_answer_the_next_go_to_the_full_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    raw, k = weights(T.Q8_0, n=160)
    head = GgufLinear([GgufWeight(int(T.Q8_0), raw, k)], greedy_copy=True)
    assert GgufLinear([GgufWeight(int(T.Q8_0), raw, k)]).high6 is None  # only where asked for
    calls = []
    kernel = ops.gguf_greedy_row
    monkeypatch.setattr(ops, "gguf_greedy_row", lambda *args: calls.append(1) or kernel(*args))
    peaked = (dequantize(raw[7:8], int(T.Q8_0), k) * 20).to(torch.bfloat16)  # column 7 leads
    found = head.greedy_row(peaked, [])
    assert found is not None and found[1] == head.logits(peaked)[1][0]
    flat = torch.zeros(1, k, dtype=torch.bfloat16)  # every logit equal: nothing to leave out
    assert head.greedy_row(flat, []) is None and len(calls) == 2
    for _ in range(GREEDY_REST):
        assert head.greedy_row(peaked, []) is None
    assert len(calls) == 2
    assert head.greedy_row(peaked, []) is not None and len(calls) == 3
