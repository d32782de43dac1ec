"""The playground page as a person sees it, for the docs: docs/playground.png at 1280x800.

    python scripts/playground_screenshot.py                       # serves the default model itself
    python scripts/playground_screenshot.py --url http://127.0.0.1:8000 --out /tmp/p.png --width 390 --height 844

It runs a seeded prompt, then hovers the least likely of the first third of the tokens, so the picture shows the
tint, one token's alternatives and the run's numbers. It needs Playwright and a Chromium (tests/e2e/browser.py finds one, or installs Debian's as
root). Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the browser and page helpers live with the e2e tests

from tests.e2e.browser import headless_chromium
from tests.e2e.playground import Playground
from tests.e2e.server import serve

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main() -> None:
    args = parse_args()
    with running_server(args.url) as url, headless_chromium() as browser:
        pg = Playground.open(browser, url, {"width": args.width, "height": args.height})
        pg.wait_for_models()
        pg.page.fill("#prompt", args.prompt)
        pg.settings(max_tokens=args.max_tokens, temperature=0.8, seed=args.seed)
        pg.run()
        probabilities = pg.page.eval_on_selector_all(
            "#output .tok", "spans => spans.map(s => Number(s.style.getPropertyValue('--p') || 1))"
        )
        early = range(max(1, len(probabilities) // 3))  # near the top, so the popover leaves the numbers in view
        least = min(early, key=probabilities.__getitem__)
        pg.tokens.nth(least).hover()
        pg.popover()
        pg.page.screenshot(path=args.out, full_page=args.full_page)
        if pg.errors:
            raise SystemExit(f"the page reported errors: {pg.errors}")
    print(f"wrote {args.out}")


@contextmanager
def running_server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url.rstrip("/")
        return
    with tempfile.TemporaryDirectory() as logs:
        servers = serve([], Path(logs))
        try:
            yield next(servers).base_url
        finally:
            servers.close()  # stops the server


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on the default model)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--full-page", action="store_true", help="the whole page, not only the window")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--seed", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    main()
