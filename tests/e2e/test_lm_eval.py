"""lm-evaluation-harness against tokenmill, and against `transformers` on the same weights: the same answers.

The task is local (tests/e2e/lm_eval_task/: 40 multiple-choice questions, a task YAML with `dataset_path: json`),
run through lm-eval's `local-completions` model with token-id requests and the server-side tokenizer (/tokenizer_info,
/tokenize, /detokenize), and through its `hf` model on transformers' Gemma 3 holding the weights the server runs
(float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.server import MODEL, Reference, Server

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TOLERANCE = 1e-3  # per-item log-likelihood, fp32 server vs fp32 transformers


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


def test_lm_eval_local_completions_equals_hf_backend(
    server: Server, reference: Reference, offline_datasets: None
) -> None:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import PreTrainedTokenizerFast

    remote = LocalCompletionsAPI(
        base_url=server.base_url + "/v1/completions",
        model=MODEL,
        tokenizer_backend="remote",
        tokenized_requests=True,
        num_concurrent=2,
        max_retries=1,
    )
    served_acc, served = evaluate(remote)

    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=reference.weights.tokenizer.backend, **special)
    # lm-eval's defaults, as a user runs it: its hf backend scores Gemma with the BOS the model needs
    hf = HFLM(pretrained=reference.model, tokenizer=tokenizer, batch_size=8, device="cpu")
    hf_acc, local = evaluate(hf)

    assert len(served) == len(local) == 40
    worst = max(abs(a - b) for doc in served for a, b in zip(served[doc], local[doc], strict=True))
    print(
        f"lm-eval tokenmill_mcq: accuracy {served_acc:.3f} (tokenmill) vs {hf_acc:.3f} (hf); max |Δ loglik| {worst:.2e}"
    )
    assert served_acc == hf_acc
    assert worst <= TOLERANCE
    # Picking by log-likelihood is what accuracy measures; check it item by item too.
    assert all(max(range(4), key=served[d].__getitem__) == max(range(4), key=local[d].__getitem__) for d in served)
