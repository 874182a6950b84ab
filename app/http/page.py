"""The page at `/`: ask a question, watch the answer stream, see what the cache did for it.

Three static files (app/http/static/: index.html, page.js, page.css; no build step, nothing
fetched from elsewhere) served at `/`, `/page.js` and `/page.css`. The page uses the public API
only (/query streamed, /documents, /collections, /health, /ready, /v1/models), with the API key
the user types in (kept in the tab's sessionStorage, sent as `Authorization: Bearer <key>`).
The files are open (`PATHS`: GET without a key, as the probes are); every API call they make
carries the key. Explicit routes, not a mount: an unknown path stays the API's JSON 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/page.js": ("page.js", "text/javascript; charset=utf-8"),
         "/page.css": ("page.css", "text/css; charset=utf-8")}
PATHS = frozenset(FILES)
# The page loads its own files and talks to this server only: no inline script, no other origin.
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                      "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def _route(name: str, media_type: str):
    async def serve() -> FileResponse:
        return FileResponse(STATIC / name, media_type=media_type, headers=HEADERS)

    return serve


for _path, (_name, _type) in FILES.items():
    router.add_api_route(_path, _route(_name, _type), methods=["GET"])
