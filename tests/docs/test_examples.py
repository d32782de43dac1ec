"""The README's and docs/api.md's examples run against a real `tokenmill serve` on the tiny random-weight model.

The convention the docs follow:

- Every fenced block tagged `python` or `bash` whose text contains `127.0.0.1:8000` is run, with that address
  replaced by the test server's. The server names the tiny model `gemma-3-270m`, as the default model is named, so
  the examples' model works. Its output is random text: an example prints what it gets and asserts nothing about it.
- A block opts out with an HTML comment on the line just above its opening fence that says why:
  `<!-- not run: REASON -->` (a block that starts a server or runs the suite, one that needs a model file).
  An opt-out without a reason fails.
- A `bash` block runs under `bash -euo pipefail` with `curl` standing for `curl --fail-with-body`: every curl must
  exit 0 and print JSON, or SSE `data:` lines when it streams, with no top-level "error".
- A `python` block runs on its own in the venv's python (the `openai` client raises on an HTTP error).

Each block is killed, with everything it started, after BLOCK_TIMEOUT_S. An example that runs this suite does not
run these tests again (NESTED).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.server_process import Server, serve
from tests.docs.markdown import ROOT, CodeBlock, code_blocks

DOCUMENTS = ("README.md", "docs/api.md")
ADDRESS = "127.0.0.1:8000"
LANGUAGES = ("python", "bash")
OPT_OUT = re.compile(r"^\s*<!--\s*not run\b:?(.*?)-->\s*$")
BLOCK_TIMEOUT_S = 120
NESTED = "TOKENMILL_DOCS_EXAMPLE"  # set in an example's environment
CURL_OUTPUTS = "TOKENMILL_CURL_OUTPUTS"

# Each curl's output and exit status are kept in a file of their own for the checks after the block.
BASH_PRELUDE = f"""\
curl() {{
  local out status=0
  out=$(mktemp "${CURL_OUTPUTS}/XXXXXX")
  command curl --fail-with-body "$@" >"$out" || status=$?
  echo "$status" >"$out.status"
  cat "$out"
  return "$status"
}}
"""


def runnable_blocks(path: Path) -> list[CodeBlock]:
    return [b for b in code_blocks(path) if b.language in LANGUAGES and ADDRESS in b.text]


def opt_out_reason(block: CodeBlock) -> str | None:
    """The reason the line above the block gives for not running it ("" if it gives none), or None to run it."""
    opt_out = OPT_OUT.match(block.before)
    return opt_out[1].strip() if opt_out else None


def example_params(root: Path) -> list[object]:
    params: list[object] = []
    for name in DOCUMENTS:
        if not (root / name).is_file():
            continue
        for block in runnable_blocks(root / name):
            reason = opt_out_reason(block)
            marks = [pytest.mark.skip(reason=f"not run: {reason}")] if reason else []
            params.append(pytest.param(block, id=f"{name}:{block.line}", marks=marks))
    return params


def run_bounded(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """(exit status, stdout and stderr together); past BLOCK_TIMEOUT_S the process and all it started are killed."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the block and anything it spawned
        output, _ = process.communicate()
        return -1, output.decode(errors="replace") + f"\n(killed after {BLOCK_TIMEOUT_S} s)"
    return process.returncode, output.decode(errors="replace")


def example_environment(outputs: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)  # `python` and `tokenmill` in a block are this venv's
    return {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        NESTED: "1",
        CURL_OUTPUTS: str(outputs),
    }


def curl_output_problem(output: str) -> str | None:
    """Why a curl's output is not a good answer (not JSON, not SSE of JSON, an "error"), or None if it is one."""
    if not output.strip():
        return "printed nothing"
    if output.lstrip().startswith("data:"):
        frames = [line for line in output.splitlines() if line.strip()]
        if bad := [line for line in frames if not line.startswith("data:")]:
            return f"not an SSE data line: {bad[0][:200]}"
        payloads = [line.removeprefix("data:").strip() for line in frames]
        return next(filter(None, map(_json_problem, (p for p in payloads if p != "[DONE]"))), None)
    return _json_problem(output)


def _json_problem(text: str) -> str | None:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return f"not JSON: {text[:200]}"
    return f"an error: {text[:300]}" if isinstance(body, dict) and "error" in body else None


def curl_problems(outputs: Path) -> list[str]:
    problems = []
    for status_file in sorted(outputs.glob("*.status")):
        output = status_file.with_suffix("").read_text(errors="replace")
        status = status_file.read_text().strip()
        if status != "0":
            problems.append(f"curl exited {status}: {output[:300]}")
        elif problem := curl_output_problem(output):
            problems.append(f"curl {problem}")
    return problems


def run_example(language: str, source: str, work: Path) -> tuple[int, str, list[str]]:
    """(exit status, output, the curls' problems) of one block run in `work`."""
    outputs = work / "curl"
    outputs.mkdir(parents=True)
    script = work / ("example.py" if language == "python" else "example.sh")
    if language == "python":
        script.write_text(source)
        command = [sys.executable, str(script)]
    else:
        script.write_text(BASH_PRELUDE + source)
        command = ["bash", "-euo", "pipefail", str(script)]
    status, output = run_bounded(command, work, example_environment(outputs))
    return status, output, curl_problems(outputs)


def address_of(server: Server) -> str:
    return server.base_url.removeprefix("http://")


@pytest.fixture(scope="module")
def docs_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if os.environ.get(NESTED):
        pytest.skip("inside an example that runs the suite")
    flags = ("--served-model-name", "gemma-3-270m", "--log-level", "warning")
    with serve(tiny_model_dir, tmp_path_factory.mktemp("docs-server"), *flags) as server:
        yield server


@pytest.mark.parametrize("block", example_params(ROOT))
def test_the_example_runs(block: CodeBlock, docs_server: Server, tmp_path: Path) -> None:
    assert opt_out_reason(block) is None, "a block that is not run says why: <!-- not run: REASON -->"
    source = block.text.replace(ADDRESS, address_of(docs_server))
    status, output, problems = run_example(block.language, source, tmp_path)
    assert status == 0 and not problems, f"exit {status}; {problems}\n{output[-3000:]}"


def test_an_example_that_gets_an_error_fails(docs_server: Server, tmp_path: Path) -> None:
    url = f"http://{address_of(docs_server)}"
    bash = f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{{\"model\": \"nope\"}}'\n"
    bash += "echo after\n"
    status, output, problems = run_example("bash", bash, tmp_path / "bash")
    assert status == 22 and "after" not in output and problems[0].startswith("curl exited 22"), (output, problems)
    python = "from openai import OpenAI\n"
    python += f"OpenAI(base_url='{url}/v1', api_key='k').completions.create(model='nope', prompt='x')\n"
    status, output, _ = run_example("python", python, tmp_path / "python")
    assert status == 1 and "NotFoundError" in output, output


def test_the_blocks_run_are_the_tagged_ones_with_the_address(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        f"```bash\ncurl {ADDRESS}/health\n```\n"  # run
        f"<!-- not run: starts a server -->\n```bash\ntokenmill serve --port 8000 && curl {ADDRESS}\n```\n"
        f"<!-- not run -->\n```python\nOpenAI(base_url='http://{ADDRESS}/v1')\n```\n"  # fails: no reason
        f"```text\n{ADDRESS}\n```\n```bash\ntokenmill serve --model ~/models/x.gguf\n```\n"  # never run
    )
    assert [(b.line, b.language, opt_out_reason(b)) for b in runnable_blocks(page)] == [
        (1, "bash", None),
        (5, "bash", "starts a server"),
        (9, "python", ""),
    ]


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ('{"id": "cmpl-1", "choices": []}', None),
        ('data: {"choices": []}\n\ndata: [DONE]\n\n', None),
        ('{"error": {"message": "bad", "code": null}}', "an error"),
        ('data: {"choices": []}\n\ndata: {"error": {"message": "lost"}}\n\ndata: [DONE]\n\n', "an error"),
        ("Internal Server Error", "not JSON"),
        ("data: {}\n\nevent: ping\n\n", "not an SSE data line"),
        ("", "printed nothing"),
    ],
    ids=["json", "sse", "json-error", "sse-error", "not-json", "sse-other-field", "empty"],
)
def test_the_curl_check_refuses_what_is_not_a_good_answer(output: str, problem: str | None) -> None:
    found = curl_output_problem(output)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem)), found


def test_a_bash_block_fails_on_a_failing_curl(tmp_path: Path) -> None:
    status, _, problems = run_example("bash", "curl -s http://127.0.0.1:9/nothing | cat\necho after\n", tmp_path)
    assert status != 0 and problems and problems[0].startswith("curl exited 7")
