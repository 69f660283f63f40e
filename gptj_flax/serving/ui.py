"""The playground page at ``/``: one static page, its script and its style sheet, shipped in the
package (``static/``) and served as they are; ``--no-ui`` leaves them out (``/`` is then a 404).

The page holds no data and calls only the public API (``/v1/models``, ``/v1/completions``,
``/health``), sending the key the person types as ``Authorization: Bearer``. So its three files stay
open without a key, as ``/health`` does, while every call the page makes needs one. Its
Content-Security-Policy lets it load and call nothing but this server.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from gptj_flax.serving.settings import ServeSettings

# Path -> (file in static/, media type). The page refers to the other two by relative URLs.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/ui/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
# Scripts, styles and connections from this server only; no inline code, no frames, no forms sent.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated, so a server upgraded in place serves its new page
}


def public_paths(settings: ServeSettings) -> tuple[str, ...]:
    """The page's paths, open without an API key (none with ``--no-ui``)."""
    return () if settings.no_ui else tuple(PAGE_FILES)


def add_page(app: FastAPI, settings: ServeSettings) -> None:
    """Route the page's files (read once, here), unless ``--no-ui``; none is in ``/openapi.json``."""
    if settings.no_ui:
        return
    static = resources.files(__package__) / "static"
    for path, (name, media_type) in PAGE_FILES.items():
        app.add_api_route(
            path, _file_route(static.joinpath(name).read_bytes(), media_type), methods=["GET"], include_in_schema=False
        )


def _file_route(content: bytes, media_type: str):
    async def page_file() -> Response:
        return Response(content, media_type=media_type, headers=HEADERS)

    return page_file
