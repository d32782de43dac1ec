"""The playground page in a real headless Chromium against the real server: it streams a run, tints every token,
shows each token's top 5 alternatives on hover and on keyboard focus, scores a prompt, shows the server's errors
(before and in the middle of a stream), asks for the API key when the server wants one, and fits a phone's width.

Each check compares what the page shows with what the API itself answers for the same request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.browser import headless_chromium
from tests.e2e.playground import PHONE, RUN_TIMEOUT_MS, Playground
from tests.e2e.server import MODEL, Server, serve

if TYPE_CHECKING:
    from playwright.sync_api import Browser

PROMPT = "The capital of France is"
SCORED = "The cat sat on the mat. Colorless green ideas sleep furiously."
KEY = "playground-test-key"
API_TIMEOUT_S = 120  # one request made directly, on a CPU that other tests may be sharing
TIMEOUT_S = 10  # the keyed server's --request-timeout-s: a long run ends in an error frame mid-stream


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with headless_chromium() as chromium:
        yield chromium


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(["--api-key", KEY, "--request-timeout-s", str(TIMEOUT_S)], tmp_path_factory.mktemp("server-keyed"))


def test_a_run_streams_tinted_tokens_with_their_alternatives(server: Server, browser: Browser, tmp_path: Path) -> None:
    pg = Playground.open(browser, server.base_url)
    pg.wait_for_models()
    assert pg.page.input_value("#model") == MODEL
    pg.page.fill("#prompt", PROMPT)
    pg.settings(max_tokens=32, temperature=0)
    pg.start()
    # tokens show while the run still goes on: the stream is read as it arrives, not at its end
    pg.page.wait_for_function(
        "() => document.querySelector('#output').getAttribute('aria-busy') === 'true'"
        " && document.querySelectorAll('#output .tok').length > 0",
        timeout=RUN_TIMEOUT_MS,
    )
    pg.wait_for_end()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "logprobs": 5}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=API_TIMEOUT_S).json()
    expected = reply["choices"][0]["logprobs"]
    assert pg.tokens.all_text_contents() == expected["tokens"]
    assert "".join(expected["tokens"]) == reply["choices"][0]["text"]

    tints = pg.page.eval_on_selector_all(
        "#output .tok",
        "spans => spans.map(s => [Number(s.style.getPropertyValue('--p')), getComputedStyle(s).backgroundColor])",
    )
    assert [p for p, _ in tints] == pytest.approx([math.exp(lp) for lp in expected["token_logprobs"]], abs=1e-4)
    least, most = min(tints), max(tints)
    assert least[1] != most[1] and "rgba(0, 0, 0, 0)" not in {colour for _, colour in tints}

    stats = pg.text("#stats")
    usage = reply["usage"]
    for part in (f"{usage['prompt_tokens']} prompt tokens", f"{usage['completion_tokens']} generated", "cached"):
        assert part in stats
    assert "first token after" in stats and "tokens/s" in stats

    pg.tokens.nth(2).hover()
    shown = pg.popover()
    assert shown["token"] == expected["tokens"][2]
    likeliest = sorted(expected["top_logprobs"][2].items(), key=lambda item: -item[1])[:5]
    assert [alt["text"] for alt in shown["alternatives"]] == [text for text, _ in likeliest]
    assert shown["alternatives"][0]["chosen"]  # greedy: the output's token is the likeliest one

    pg.page.mouse.move(0, 0)
    pg.page.focus("#run")  # the output is the next tab stop (Stop is disabled once a run is over)
    pg.page.keyboard.press("Tab")
    assert pg.page.evaluate("document.activeElement.textContent") == expected["tokens"][0]
    assert pg.popover()["token"] == expected["tokens"][0] and len(pg.popover()["alternatives"]) == 5
    pg.page.keyboard.press("ArrowRight")
    assert pg.popover()["token"] == expected["tokens"][1]
    pg.page.keyboard.press("Escape")
    assert pg.page.is_hidden("#popover")

    assert pg.fits_width()
    pg.page.screenshot(path=tmp_path / "playground.png")
    assert (tmp_path / "playground.png").stat().st_size > 0
    assert pg.errors == []


def test_score_mode_tints_the_prompts_own_tokens(server: Server, browser: Browser) -> None:
    pg = Playground.open(browser, server.base_url)
    pg.wait_for_models()
    pg.page.fill("#prompt", SCORED)
    pg.run("score", keyboard=True)
    body = {"model": MODEL, "prompt": SCORED, "echo": True, "max_tokens": 0, "logprobs": 5}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=API_TIMEOUT_S).json()
    expected = reply["choices"][0]["logprobs"]
    assert pg.tokens.all_text_contents() == expected["tokens"]
    assert expected["token_logprobs"][0] is None and "none" in (pg.tokens.first.get_attribute("class") or "")
    pg.tokens.first.hover()
    assert "No probability" in pg.popover()["text"]
    pg.tokens.nth(3).hover()
    assert pg.popover()["token"] == expected["tokens"][3] and len(pg.popover()["alternatives"]) == 5

    known = [lp for lp in expected["token_logprobs"] if lp is not None]
    stats = pg.text("#stats")
    assert f"{reply['usage']['prompt_tokens']} prompt tokens" in stats
    assert f"perplexity {math.exp(-sum(known) / len(known)):.2f}" in stats
    assert pg.errors == []


def test_a_bad_value_shows_the_servers_message(server: Server, browser: Browser) -> None:
    pg = Playground.open(browser, server.base_url)
    pg.wait_for_models()
    pg.settings(temperature=5)
    pg.run()
    body = {"model": MODEL, "prompt": "x", "temperature": 5}
    error = httpx.post(server.base_url + "/v1/completions", json=body, timeout=API_TIMEOUT_S).json()["error"]
    shown = pg.text("#error")
    assert shown.startswith("Error 400 (temperature)") and error["message"] in shown
    assert pg.tokens.count() == 0

    pg.settings(temperature=0, max_tokens=4)
    pg.run()
    assert pg.page.is_hidden("#error") and pg.tokens.count() > 0


def test_the_page_fits_a_phone(server: Server, browser: Browser, tmp_path: Path) -> None:
    pg = Playground.open(browser, server.base_url, PHONE)
    pg.wait_for_models()
    pg.settings(max_tokens=24, seed=1)
    pg.run()
    assert pg.tokens.count() > 0
    pg.tokens.nth(1).hover()
    pg.popover()
    assert pg.fits_width()
    pg.page.screenshot(path=tmp_path / "phone.png", full_page=True)
    assert pg.errors == []


def test_a_401_asks_for_the_key_which_the_tab_keeps(keyed_server: Server, browser: Browser) -> None:
    pg = Playground.open(browser, keyed_server.base_url)
    pg.page.wait_for_selector("#error:not([hidden])")  # the model list needs the key
    assert pg.text("#error").startswith("Error 401") and "You didn't provide an API key" in pg.text("#error")
    assert pg.page.is_visible("#api-key") and pg.page.evaluate("document.activeElement.id") == "api-key"

    pg.page.fill("#api-key", KEY)
    pg.page.press("#api-key", "Enter")
    pg.wait_for_models()
    assert pg.page.is_hidden("#error")
    pg.settings(max_tokens=4)
    pg.run()
    assert pg.tokens.count() > 0 and pg.page.is_hidden("#error")

    pg.page.reload()
    pg.wait_for_models()
    assert pg.page.input_value("#api-key") == KEY and pg.page.is_hidden("#error")


def test_an_error_frame_mid_stream_is_shown(keyed_server: Server, browser: Browser) -> None:
    pg = Playground.open(browser, keyed_server.base_url)
    pg.page.evaluate(f"sessionStorage.setItem('tokenmill.apiKey', {KEY!r})")
    pg.page.reload()
    pg.wait_for_models()
    pg.settings(max_tokens=4000)
    pg.page.click(".advanced summary")
    pg.page.check('[data-field="ignore_eos"]')
    pg.run()
    shown = pg.text("#error")
    # the 200 went out before the limit struck: the error came as an SSE frame, and it carries the server's message
    assert shown.startswith("Error (request_timeout)")
    assert f"did not finish within this server's limit of {TIMEOUT_S} s" in shown
