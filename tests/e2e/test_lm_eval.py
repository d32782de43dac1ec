"""lm-evaluation-harness against tokenmill, and against `transformers` on the same weights: the same answers.

The task is local (tests/e2e/lm_eval_task/: 40 multiple-choice questions, a task YAML with `dataset_path: json`),
run through lm-eval's `local-completions` model with token-id requests, and through its `hf` model (with its defaults)
on transformers' Gemma 3 holding the weights the server runs (float32).

Gemma is scored after a BOS, which lm-eval's two tokenizer settings for `local-completions` reach differently:
- `tokenizer_backend=remote` (the server's /tokenize) never adds one, so the server needs --add-bos-to-token-prompts;
- `tokenizer_backend=huggingface` with `add_bos_token=True` sends it, to a server that takes ids as sent (its default).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.server import MODEL, Reference, Server, serve

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TOLERANCE = 1e-4  # per-item log-likelihood, fp32 server vs fp32 transformers
# 160 scored requests a run: minutes on a quiet machine, several times that on a loaded one, which is slow, not wrong
pytestmark = pytest.mark.timeout(1800)


def task_config() -> dict[str, Any]:
    config = yaml.safe_load((TASK_DIR / "tokenmill_mcq.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(TASK_DIR / name) for split, name in files.items()}
    return config


def evaluate(lm: Any) -> tuple[float, dict[int, list[float]]]:
    """Accuracy and, per document, the log-likelihood of each choice."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_defaults=False)  # only the task given here: skips indexing lm-eval's thousands
    out = simple_evaluate(
        model=lm, tasks=[task_config()], task_manager=tasks, log_samples=True, bootstrap_iters=0, random_seed=0
    )
    assert out is not None
    accuracy = out["results"]["tokenmill_mcq"]["acc,none"]
    logliks = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"]["tokenmill_mcq"]}
    return accuracy, logliks


@pytest.fixture
def offline_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The fp32 server as lm-eval's remote tokenizer needs it: a BOS before token-id prompts that lack one."""
    yield from serve(["--dtype", "float32", "--add-bos-to-token-prompts"], tmp_path_factory.mktemp("server-bos"))


@pytest.fixture(scope="module")
def hf_tokenizer_dir(reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer as a local transformers tokenizer directory (what `tokenizer=` names for lm-eval)."""
    from transformers import PreTrainedTokenizerFast

    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=reference.weights.tokenizer.backend, **special)
    path = tmp_path_factory.mktemp("gemma-tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_scores(reference: Reference, hf_tokenizer_dir: Path) -> tuple[float, dict[int, list[float]]]:
    """lm-eval's `hf` model with its defaults, as a user runs it: it scores Gemma with the BOS the model needs."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        tokenizer = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
        return evaluate(HFLM(pretrained=reference.model, tokenizer=tokenizer, batch_size=8, device="cpu"))


def assert_same_scores(
    served: tuple[float, dict[int, list[float]]], local: tuple[float, dict[int, list[float]]], label: str
) -> None:
    (served_acc, served_ll), (hf_acc, local_ll) = served, local
    assert len(served_ll) == len(local_ll) == 40
    worst = max(abs(a - b) for doc in served_ll for a, b in zip(served_ll[doc], local_ll[doc], strict=True))
    print(
        f"lm-eval tokenmill_mcq ({label}): accuracy {served_acc:.3f} vs {hf_acc:.3f} (hf); max |Δ loglik| {worst:.2e}"
    )
    assert served_acc == hf_acc
    assert worst <= TOLERANCE
    # Picking by log-likelihood is what accuracy measures; check it item by item too.
    best = {d: max(range(4), key=local_ll[d].__getitem__) for d in local_ll}
    assert all(max(range(4), key=served_ll[d].__getitem__) == best[d] for d in served_ll)


def test_remote_tokenizer_with_add_bos_to_token_prompts_equals_hf_backend(
    bos_server: Server, hf_scores: tuple[float, dict[int, list[float]]], offline_datasets: None
) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    remote = LocalCompletionsAPI(
        base_url=bos_server.base_url + "/v1/completions",
        model=MODEL,
        tokenizer_backend="remote",
        tokenized_requests=True,
        num_concurrent=2,
        max_retries=1,
    )
    assert_same_scores(evaluate(remote), hf_scores, "remote tokenizer, --add-bos-to-token-prompts")


def test_local_tokenizer_with_add_bos_token_equals_hf_backend(
    server: Server,
    hf_tokenizer_dir: Path,
    hf_scores: tuple[float, dict[int, list[float]]],
    offline_datasets: None,
) -> None:
    """The default server reads ids as sent: lm-eval's own tokenizer with add_bos_token=True sends the BOS."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    local = LocalCompletionsAPI(
        base_url=server.base_url + "/v1/completions",
        model=MODEL,
        tokenizer_backend="huggingface",
        tokenizer=str(hf_tokenizer_dir),
        add_bos_token=True,
        tokenized_requests=True,
        num_concurrent=2,
        max_retries=1,
    )
    assert_same_scores(evaluate(local), hf_scores, "huggingface tokenizer, add_bos_token=True")
