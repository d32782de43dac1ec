"""The playground: `GET /` and its static files (tokenmill/web/), a page that talks to this server's own API.

The page and its assets need no API key (they hold nothing secret; the API calls they make still do), so their
paths are listed in PAGE_PATHS for the bearer auth. Only the files in tokenmill/web/ with a known type are served,
looked up by exact name, so no request path ever reaches the file system. They stay out of the OpenAPI document,
which describes the API, not the page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.responses import FileResponse

from tokenmill.api import errors

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
ASSET_PREFIX = "/web/"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page loads nothing from elsewhere, so the browser may refuse anything else (an injected script included).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag), so an upgraded server never runs a stale script
}


def _assets() -> dict[str, Path]:
    files = sorted(WEB_DIR.iterdir()) if WEB_DIR.is_dir() else []
    return {ASSET_PREFIX + path.name: path for path in files if path.suffix in MEDIA_TYPES and path.is_file()}


ASSETS = _assets()
PAGE_PATHS = frozenset({"/", *ASSETS})
router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    return _file(ASSET_PREFIX + "index.html")


@router.get(ASSET_PREFIX + "{name}")
async def asset(name: str) -> FileResponse:
    return _file(ASSET_PREFIX + name)


def _file(path: str) -> FileResponse:
    found = ASSETS.get(path)
    if found is None:
        raise errors.not_found(f"Invalid URL (GET {path})")
    return FileResponse(found, media_type=MEDIA_TYPES[found.suffix], headers=HEADERS)
