"""The playground page (tokenmill/api/web.py, tokenmill/web/): `/` and every file it loads are served with their types,
without the API key, outside the OpenAPI document; the page asks nothing of the internet and ships in the package."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import assert_openai_error
from tests.api.fake_engine import FakeEngine
from tokenmill.api.app import create_app
from tokenmill.api.web import WEB_DIR
from tokenmill.config import Config

ROOT = Path(__file__).resolve().parents[2]
TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}


@pytest.fixture
def secured(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, Config(api_key=("k1",))), raise_server_exceptions=False) as client:
        yield client


def referenced_assets() -> set[str]:
    """Every /web/ path the page loads: from index.html's src/href, and each module's `import ... from "./x.js"`."""
    html = (WEB_DIR / "index.html").read_text()
    paths = set(re.findall(r'(?:src|href)="(/web/[^"]+)"', html))
    for module in WEB_DIR.glob("*.js"):
        paths |= {f"/web/{name}" for name in re.findall(r'from "\./([^"]+)"', module.read_text())}
    return paths


def test_the_page_and_everything_it_loads_are_served_with_their_types(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>tokenmill playground</title>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assets = referenced_assets()
    assert {"/web/style.css", "/web/app.js", "/web/api.js", "/web/form.js", "/web/tokens.js"} <= assets
    for path in assets:
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"].split(";")[0] == TYPES[Path(path).suffix], path
        assert response.content == (WEB_DIR / Path(path).name).read_bytes()


def test_the_page_needs_no_key_but_the_api_it_calls_does(secured: TestClient) -> None:
    for path in ["/", *referenced_assets()]:
        assert secured.get(path).status_code == 200, path
    assert_openai_error(secured.get("/v1/models"), 401, "invalid_api_key")
    assert_openai_error(secured.post("/v1/completions", json={}), 401, "invalid_api_key")
    assert_openai_error(secured.get("/web/missing.js"), 401, "invalid_api_key")  # only the page's own files are public
    assert secured.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200


@pytest.mark.parametrize("path", ["/web/missing.js", "/web/..%2Fapi%2Fweb.py", "/web/", "/web/index"])
def test_anything_else_under_web_is_an_openai_404(client: TestClient, path: str) -> None:
    assert_openai_error(client.get(path), 404, "not_found")


def test_the_page_is_not_in_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/v1/completions" in paths and not any(p == "/" or p.startswith("/web") for p in paths)


def test_the_page_loads_nothing_from_elsewhere() -> None:
    for path in WEB_DIR.iterdir():
        if path.suffix in {".html", ".css", ".js"}:
            assert not re.search(r"https?://|//cdn|@import", path.read_text()), path.name


def test_every_file_of_the_page_ships_in_the_package() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["tokenmill.web"]
    files = [path.name for path in WEB_DIR.iterdir() if path.is_file()]
    assert files and all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in files), (files, patterns)
