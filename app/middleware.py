"""ASGI middleware (plain ASGI, so streaming responses and disconnects pass through untouched).

- `RequestContext`: gives every response an `X-Request-ID` (the client's, if it sent a sane
  one, else a new one), sets it for the logs, counts the request by route and status, and writes
  one access-log line when the response has been sent. An exception that escaped every handler
  is logged and answered with a 500 in the usual error shape.
- `BodyLimit`: answers 413 for a body over `max_body_bytes`, before reading it when
  Content-Length says so, else as soon as the chunks received pass the limit.
- `ApiKey`: when a key is configured, refuses requests without `Authorization: Bearer <key>`
  (401), except the probes /health, /ready and /metrics.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import logs
from .errors import APIError
from .metrics import Metrics

access_log = logging.getLogger("hypic.access")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = ("/health", "/ready", "/metrics")


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
        except Exception:
            access_log.exception("unhandled error", extra={"path": scope["path"]})
            if status is None:  # nothing sent yet: answer, so that even a 500 carries the request id
                await APIError(500, "internal error; see the server log", type="server_error").response()(scope, receive, send_with_id)
        finally:
            status = status or 500
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route, str(status)).inc()
            access_log.info("request", extra={"method": scope["method"], "path": scope["path"], "route": route,
                                              "status": status, "ms": round((time.perf_counter() - started) * 1000, 3)})
            logs.request_id.reset(token)


class ApiKey:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            error = APIError(401, "authorization: missing or invalid API key (expected 'Authorization: Bearer <key>')",
                             type="authentication_error", param="authorization", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a chunked body passes the limit; the error handlers answer 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = BodyTooLarge(self.max_bytes)
            return await APIError(413, f"body: {error.detail}", param="body", code="body_too_large").response()(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
