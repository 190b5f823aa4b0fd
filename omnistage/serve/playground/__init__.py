"""The web playground: one static page at ``/`` that speaks through the ``/v1`` API.

The page and its assets (``/playground/...``: plain HTML, JavaScript modules and CSS shipped
in this package, no build step) are public; the page sends the API key the user types as
``Authorization: Bearer`` on its own ``/v1`` calls. Asset URLs are relative, so the page
also works behind a proxy that serves the API under a path prefix.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_PATH", "STATIC_DIR", "mount_playground"]

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_PATH = "/playground"

# Same-origin scripts and styles only; audio comes from fetch, downloads from blob: URLs.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "media-src 'self' blob:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def mount_playground(app: FastAPI) -> None:
    """Serve the page at ``GET /`` and its assets under :data:`ASSETS_PATH`.

    Raises:
        RuntimeError: the static files are missing from the installed package.
    """
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise RuntimeError(
            f"the playground's files are missing ({index}); reinstall omnistage, "
            "or serve without the playground (--no-playground)"
        )

    @app.get("/", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)

    app.mount(ASSETS_PATH, StaticFiles(directory=STATIC_DIR), name="playground")
