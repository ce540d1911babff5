"""The web playground: one self-contained HTML page (static/playground.html: its CSS and JavaScript inline, nothing
fetched from elsewhere, no build step) at /playground, and / redirecting to it.

The page talks to the server's own OpenAI routes from the browser (fetch + ReadableStream over the SSE streams);
the API key a user types stays in that browser tab (sessionStorage) and reaches the server only as the bearer
token of those requests, so the page itself needs no authentication.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

PATH = "/playground"
# The page may load nothing from anywhere (it works offline and cannot leak what is typed to a third party), may
# call only this server, and may not be framed by another site.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@cache
def page() -> str:
    return files("jserve.server").joinpath("static/playground.html").read_text(encoding="utf-8")


async def playground(request: Request) -> Response:
    return HTMLResponse(page(), headers=HEADERS)


async def to_playground(request: Request) -> Response:
    return RedirectResponse(PATH, status_code=307)


def playground_routes() -> list[Route]:
    """GET /playground (the page) and GET / (a redirect to it)."""
    return [Route(PATH, playground, methods=["GET"]), Route("/", to_playground, methods=["GET"])]
