"""Driving the playground page (tokenmill/web/) in a browser: open it, fill the settings, run, read the output.

Shared by tests/e2e/test_playground.py and scripts/playground_screenshot.py. Every wait is bounded: the page's default
timeout covers each Playwright call, and a run gets RUN_TIMEOUT_MS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
STEP_TIMEOUT_MS = 15_000  # any one page action or wait, but a run
RUN_TIMEOUT_MS = 120_000  # one run on the real model, on a CPU that other tests may be sharing


@dataclass
class Playground:
    page: Page
    errors: list[str] = field(default_factory=list)  # the page's uncaught exceptions and console errors

    @classmethod
    def open(cls, browser: Browser, url: str, viewport: dict[str, int] = DESKTOP) -> Playground:
        """A new tab on the page, its model list loaded."""
        page = browser.new_page(viewport=viewport)  # type: ignore[arg-type]
        page.set_default_timeout(STEP_TIMEOUT_MS)
        page.set_default_navigation_timeout(STEP_TIMEOUT_MS)
        playground = cls(page)
        page.on("pageerror", lambda error: playground.errors.append(str(error)))
        page.on("console", lambda message: playground.errors.append(message.text) if message.type == "error" else None)
        page.goto(url + "/")
        return playground

    def wait_for_models(self) -> None:
        # a function, not a bare expression: Playwright evals an expression, which the page's CSP forbids
        self.page.wait_for_function("() => document.querySelector('#model').value !== ''")

    def settings(self, **fields: Any) -> None:
        """Type each value into the settings input of that request field ('' empties it)."""
        for name, value in fields.items():
            self.page.fill(f'[data-field="{name}"]', str(value))

    def start(self, mode: str = "generate", keyboard: bool = False) -> None:
        """Start a run: the Run button, or Ctrl+Enter in the prompt box."""
        self.page.check(f'input[name="mode"][value="{mode}"]')
        if keyboard:
            self.page.focus("#prompt")
            self.page.keyboard.press("Control+Enter")
        else:
            self.page.click("#run")

    def run(self, mode: str = "generate", keyboard: bool = False) -> None:
        """A run, waited for until it has ended, however it ended."""
        self.start(mode, keyboard)
        self.wait_for_end()

    def wait_for_end(self) -> None:
        self.page.wait_for_selector('#output[aria-busy="false"]', timeout=RUN_TIMEOUT_MS)

    @property
    def tokens(self) -> Locator:
        return self.page.locator("#output .tok")

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)

    def popover(self) -> dict[str, Any]:
        """The open popover: its token, its text, and each alternative's text, percentage and whether it is the one
        the output has."""
        self.page.wait_for_selector("#popover:not([hidden])")
        return self.page.evaluate(
            """() => {
              const pop = document.querySelector('#popover');
              const alternatives = [...pop.querySelectorAll('.alt')].map((row) => ({
                text: JSON.parse(row.querySelector('code').textContent),
                percent: row.querySelector('.alt-p').textContent,
                chosen: row.classList.contains('chosen'),
              }));
              const token = JSON.parse(pop.querySelector('.pop-token').textContent);
              return {token, alternatives, text: pop.innerText};
            }"""
        )

    def fits_width(self) -> bool:
        """Nothing sticks out sideways: the page never scrolls horizontally at this window's width."""
        return bool(self.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))
