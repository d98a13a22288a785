"""GET /: the chat page, three static files inside the package (app/static: chat.html, chat.js,
chat.css), no build step and nothing from a CDN. The page runs in the browser and calls this
server's own /v1/models and /v1/chat/completions, same origin with JSON bodies, so the Host check
(app/trusted_host.py) and the JSON content-type check (app/request_checks.py) let it through
unchanged. The page itself is not behind --api-key (it holds no data): the key is typed into the
page, kept in the browser's localStorage and sent as ``Authorization: Bearer`` to the API.
--disable-chat-page leaves the routes out (GET / is then a 404)."""
from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# path -> (file in app/static, media type)
PAGE_FILES: dict[str, tuple[str, str]] = {
    "/": ("chat.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}

# Only this server's own scripts, styles and API: no inline script, no other origin, no framing.
PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file_route(path: str, name: str, media_type: str) -> Route:
    body = files("pagedserve.app").joinpath("static", name).read_bytes()  # read once: the package does not change

    async def endpoint(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return Route(path, endpoint, methods=["GET"], include_in_schema=False)


def chat_page_routes() -> list[Route]:
    """The page's routes (GET; HEAD too), left out of /openapi.json: they are not API."""
    return [_file_route(path, name, media_type) for path, (name, media_type) in PAGE_FILES.items()]
