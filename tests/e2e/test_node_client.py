"""The official `openai` Node package (pinned in tests/e2e/node/package-lock.json) against the real server.

The script asserts on its own and exits non-zero on failure; here its results must also equal the Python client's.
`npm ci` installs the package the first time (node_modules/ is git-ignored).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

from tests.e2e.server import MODEL, Server

NODE_DIR = Path(__file__).parent / "node"
PROMPT = "The capital of France is"  # the script's prompt


def npm_ci() -> None:
    lock = NODE_DIR / "package-lock.json"
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    if installed.exists() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return
    npm = shutil.which("npm")
    assert npm is not None, "npm is needed for the Node client test (Node.js 20 or later)"
    subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300, stdin=subprocess.DEVNULL
    )


def test_official_node_client(server: Server) -> None:
    npm_ci()
    node = shutil.which("node")
    assert node is not None
    env = {**os.environ, "TOKENMILL_BASE_URL": server.base_url, "TOKENMILL_MODEL": MODEL}
    done = subprocess.run(
        [node, "check.mjs"],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    client = server.client()
    python = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result["text"] == result["streamed"] == python.choices[0].text
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert result["tokens"] == lp.tokens
    assert result["token_logprobs"][0] is None and lp.token_logprobs[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(result["token_logprobs"][1:], lp.token_logprobs[1:]))
