"""A headless Chromium for the playground's browser test: the system's Chromium, driven by Playwright.

Playwright's own browser download (`playwright install`) fetches from its CDN, which CI machines cannot count on
reaching, so the test points Playwright at an installed Chromium (`executable_path`). Where none is installed and we
are root on a machine with apt-get (a fresh CI machine), Debian's `chromium` package is installed, with an
`apt-get update` first only if the plain install fails; anywhere else the test is skipped, saying what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM_ENV = "TOKENMILL_CHROMIUM"  # a Chromium (or Chrome) binary to use instead of looking for one
NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
APT_TIMEOUT_S = 900
LAUNCH_TIMEOUT_MS = 60_000


@contextmanager
def headless_chromium() -> Iterator[Browser]:
    """Playwright's Chromium on the system's binary; skips the test when there is none (or no Playwright)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is in the `test` extra")
    executable = chromium()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, timeout=LAUNCH_TIMEOUT_MS)
        try:
            yield browser
        finally:
            browser.close()


def chromium() -> str:
    """The path of a Chromium binary, installed with apt-get if need be (and allowed); else the test is skipped."""
    found = find_chromium()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"no Chromium found ({', '.join(NAMES)} or ${CHROMIUM_ENV}): install Debian's `chromium` package")
    output = apt_install_chromium()
    found = find_chromium()
    if found is None:
        pytest.skip(f"no Chromium found, and `apt-get install -y chromium` did not provide one:\n{output}")
    return found


def find_chromium() -> str | None:
    given = os.environ.get(CHROMIUM_ENV)
    if given:
        return given
    return next((path for name in NAMES if (path := shutil.which(name)) is not None), None)


def apt_install_chromium() -> str:
    """Install Debian's chromium; on failure (stale package lists, typically) update the lists and try once more.
    Returns the last command's output tail, for the skip reason when even that fails."""
    install = ["apt-get", "install", "-y", "chromium"]
    result = _apt(install)
    if result.returncode != 0:
        _apt(["apt-get", "update"])
        result = _apt(install)
    return result.stdout[-2000:]


def _apt(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(
            argv,
            check=False,  # the caller reads the return code: a failed install is retried after an update
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=APT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(argv, -1, f"{' '.join(argv)} timed out after {exc.timeout} s", "")
