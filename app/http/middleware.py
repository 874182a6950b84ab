"""ASGI middleware (plain ASGI, so streaming responses and disconnects pass through untouched).

- `RequestContext`: gives every response an `X-Request-ID` (the client's, if it sent a sane
  one, else a new one), sets it for the logs, counts the request by route and status, and writes
  one access-log line when the response has been sent (probes at debug level). An exception
  that escaped every handler is logged and answered with a 500 in the usual error shape.
- `HeaderLimit`: answers 431 for more than `max_headers` header fields or more than
  `max_header_bytes` of them (h11 bounds only a head that arrives in pieces).
- `HostCheck`: answers 400 for a `Host` that `allowed_hosts` does not list, which closes DNS
  rebinding (a page on evil.example whose name now resolves to 127.0.0.1); probes pass.
- `OriginCheck` (only without an API key): answers 403 to a state-changing request a browser
  sent from a page on an origin not in `cors_origins`, to a `text/plain` upload without an
  `X-Requested-With` header, and to a form (multipart or urlencoded) with neither that header
  nor an `Origin` (which every current browser sends with a form, and which is checked
  above). A page can send any of these without asking (a "simple" request, no CORS
  preflight), and older browsers sent no `Origin` with them; everything else a page sends
  cross-origin the browser preflights, and the CORS middleware allows only `cors_origins`.
- `BodyLimit`: answers 413 for a body over `max_body_bytes`, before reading it when
  Content-Length says so, else as soon as the chunks received pass the limit; 408 (and closes
  the connection) when no part of a body arrives for `body_timeout_s`, or the whole body has
  not arrived `body_deadline_s` after its head (a body trickling in a byte at a time).
- A client that disconnects before its body is complete is counted and logged with status
  499 (nginx's "client closed request"), not as a 500: nobody is there to answer.
- `ApiKey`: when keys are configured, refuses requests without `Authorization: Bearer <key>`
  of one of them (401; the scheme in any case), and a request with two `Authorization` headers
  (400), except the probes /health, /ready and /metrics and a GET of the page's static files
  (`open_files`: `/`, `/page.js`, `/page.css`); a request it lets through carries the
  key's tenant in `scope["state"]["tenant"]` (app/service/tenants.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from typing import Sequence
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..service import logs
from ..service.metrics import Metrics
from .errors import CLIENT_CLOSED, APIError, shown

access_log = logging.getLogger("hypic.access")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = ("/health", "/ready", "/metrics")
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Form bodies a page can send to any site without a CORS preflight (as it can text/plain).
SIMPLE_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")


def header_values(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of header `name` (lower case) in the request, in order."""
    return [v for k, v in scope["headers"] if k == name]


def host_name(host: str) -> str:
    """The name of a Host header, without port or trailing dot: `[::1]:8000` -> `[::1]`."""
    host = host.strip().lower()
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    return name.rstrip(".")


def route_label(scope: Scope) -> str:
    """The route template a request is counted under: the route that handled it, else the one its
    path names (a request refused before routing, e.g. a 413 or a 401, counts under the route it
    was for; a 405 under its path's), else "unmatched" (a path no route has: a 404)."""
    route = getattr(scope.get("route"), "path", None)
    if route:
        return route
    partial = None
    for candidate in _routes(scope.get("app")):
        match, _ = candidate.matches(scope)
        if match is Match.FULL:
            return getattr(candidate, "path", None) or "unmatched"
        if match is Match.PARTIAL and partial is None:
            partial = getattr(candidate, "path", None)
    return partial or "unmatched"


def _routes(app) -> list:
    """The app's routes, those of included routers listed one by one."""
    routes = getattr(getattr(app, "router", None), "routes", [])
    try:
        from fastapi.routing import iter_route_contexts  # FastAPI >= 0.165 keeps included routers as one route each
    except ImportError:
        return list(routes)
    return [context.original_route for context in iter_route_contexts(routes)]


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]).get("x-request-id", "")
        rid = sent if _CLIENT_ID.match(sent) else uuid.uuid4().hex
        token = logs.request_id.set(rid)
        started = time.perf_counter()
        status = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # the client left mid-body (errors.install answers it inside FastAPI): not a server error
            status = status or CLIENT_CLOSED
        except Exception:
            access_log.exception("unhandled error", extra={"path": scope["path"]})
            if status is None:  # nothing sent yet: answer, so that even a 500 carries the request id
                await APIError(500, "internal error; see the server log", type="server_error").response()(scope, receive, send_with_id)
        finally:
            status = status or 500
            route = route_label(scope)
            self.metrics.requests.labels(route, str(status)).inc()
            level = logging.DEBUG if scope["path"] in OPEN_PATHS else logging.INFO  # probes come every few seconds
            access_log.log(level, "request", extra={"method": scope["method"], "path": scope["path"], "route": route,
                                              "status": status, "ms": round((time.perf_counter() - started) * 1000, 3)})
            logs.request_id.reset(token)


class ApiKey:
    def __init__(self, app: ASGIApp, keys: dict[str, str], open_files: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.open_files = open_files  # paths a GET reads without a key: the page's static files (app/http/page.py)
        # Looked up by digest: the lookup's time depends on the digest of what was sent, not on how
        # much of a real key it matches.
        self._tenants = {hashlib.sha256(key.encode()).digest(): tenant for key, tenant in keys.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or (scope["method"] == "GET" and scope["path"] in self.open_files):
            return await self.app(scope, receive, send)
        given = header_values(scope, b"authorization")
        if len(given) > 1:  # which one counts would depend on the proxy in front: refuse both
            error = APIError.invalid("authorization", f"sent {len(given)} times; send one 'Authorization: Bearer <key>' header")
            return await error.response()(scope, receive, send)
        scheme, _, token = (given[0] if given else b"").strip().partition(b" ")
        tenant = self._tenants.get(hashlib.sha256(token.strip()).digest())
        if scheme.lower() != b"bearer" or tenant is None:
            error = APIError(401, "authorization: missing or invalid API key (expected 'Authorization: Bearer <key>')",
                             type="authentication_error", param="authorization", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            return await error.response()(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class HeaderLimit:
    def __init__(self, app: ASGIApp, max_headers: int, max_bytes: int) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
            problem = (f"{len(headers)} header fields, more than the {self.max_headers} allowed" if len(headers) > self.max_headers
                       else f"{size} bytes of header fields, more than the {self.max_bytes} allowed" if size > self.max_bytes else None)
            if problem:
                error = APIError(431, f"headers: {problem}", param="headers", code="headers_too_large", headers={"Connection": "close"})
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class HostCheck:
    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.names = {host_name(h) for h in allowed if not h.startswith("*.")}
        self.suffixes = tuple(h[1:].lower() for h in allowed if h.startswith("*."))  # "*.example.com" -> ".example.com"

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return self.any or name in self.names or name.endswith(self.suffixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            for host in header_values(scope, b"host"):  # none: not a browser (HTTP/1.0); let it pass
                if not self.allows(host.decode("latin-1")):
                    error = APIError(400, f"host: {shown(host.decode('latin-1'))} is not an allowed host name (HYPIC_ALLOWED_HOSTS)",
                                     param="host", code="host_not_allowed")
                    return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class OriginCheck:
    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def allows(self, origin: str, host: str) -> bool:
        """Whether a page on `origin` may write: a listed origin, or the gateway's own (its /docs page)."""
        origin = origin.strip().lower()
        if self.any or origin in self.origins:
            return True
        try:
            return origin != "null" and bool(host) and urlsplit(origin).netloc == host.strip().lower()
        except ValueError:  # not a URL ("http://[::1")
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in UNSAFE_METHODS:
            return await self.app(scope, receive, send)
        host = b"".join(header_values(scope, b"host")[:1]).decode("latin-1")
        for origin in header_values(scope, b"origin"):
            if not self.allows(origin.decode("latin-1"), host):
                error = APIError(403, f"origin: {shown(origin.decode('latin-1'))} may not change this server: it is not in "
                                      "HYPIC_CORS_ORIGINS, and no API key is set", type="permission_error", param="origin",
                                 code="origin_not_allowed")
                return await error.response()(scope, receive, send)
        content_type = b"".join(header_values(scope, b"content-type")[:1]).split(b";")[0].strip().lower()
        asked = bool(header_values(scope, b"x-requested-with"))
        if content_type == b"text/plain" and not asked:
            error = APIError(403, "content-type: without an API key, a text/plain upload needs an 'X-Requested-With' header "
                                  "(any value), which a page on another site cannot add unasked; or send it as text/markdown",
                             type="permission_error", param="content-type", code="simple_request_refused")
            return await error.response()(scope, receive, send)
        if content_type in SIMPLE_FORMS and not asked and not header_values(scope, b"origin"):
            error = APIError(403, "content-type: without an API key, a form upload needs an 'X-Requested-With' header (any "
                                  "value; curl -H 'X-Requested-With: curl') or a browser's Origin header: a page on another "
                                  "site can send a form without either", type="permission_error", param="content-type",
                             code="simple_request_refused")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a chunked body passes the limit; the error handlers answer 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyTimeout(HTTPException):
    """Raised from `receive` when the body stops arriving, or is not complete by its deadline;
    the error handlers answer 408 and the connection closes."""

    def __init__(self, message: str) -> None:
        super().__init__(408, message, headers={"Connection": "close"})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout: float | None = None, deadline: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = BodyTooLarge(self.max_bytes)
            return await APIError(413, f"body: {error.detail}", param="body", code="body_too_large").response()(scope, receive, send)
        seen = 0
        complete = False
        ends = None if self.deadline is None else time.monotonic() + self.deadline

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # after the body, receive() waits for the disconnect: no deadline
                return await receive()
            left = None if ends is None else max(ends - time.monotonic(), 0.0)
            wait = left if self.idle_timeout is None or (left is not None and left < self.idle_timeout) else self.idle_timeout
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                if wait == left:  # a body trickling in, a byte now and then, is cut off here
                    raise BodyTimeout(f"the request body did not arrive within {self.deadline:g} s") from None
                raise BodyTimeout(f"no part of the request body arrived for {self.idle_timeout:g} s") from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
