"""Error responses: every failure the gateway reports has one JSON shape, OpenAI's.

    {"error": {"message": "top_k: must be <= 32", "type": "invalid_request_error",
               "param": "top_k", "code": null}}

`message` starts with the offending field when there is one. This is the one place where the
service's domain errors (app/service/errors.py) become status codes: `InvalidRequestError`
(the engine's and the service's, naming the field) a 400 (a write to a shared collection the
tenant only reads a 403), `QueueFullError` and `QuotaExceededError` a 429 and `NotReadyError` a
503, all three with Retry-After; pydantic validation errors (`loc`) a 400 too, so a
bad request is always a 4xx and never a 500. Anything else becomes a logged 500 without
internals in the body (`middleware.RequestContext`).

Input is echoed in messages through `shown()`, at most about 100 characters; whatever a
message holds, it is cut at `MAX_MESSAGE_CHARS` and lone surrogates are escaped, so an error
body is small and always encodes.
"""

from __future__ import annotations

import re
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hypic_core.errors import InvalidRequestError, PromptTooLongError

from ..service.errors import (CollectionReadOnlyError, NotReadyError, QueueFullError, QuotaExceededError, TextTooLongError,
                              TooManyItemsError, UnknownCollectionError, UnknownDocumentError)

MAX_MESSAGE_CHARS = 2000
CLIENT_CLOSED = 499  # nginx's status for "client closed the connection before the answer": metrics and logs only
MAX_PARAM_CHARS = 200
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 100
_REPR.maxlevel = 3


def shown(value: object) -> str:
    """`repr(value)`, shortened for an error message: strings past 100 characters, containers
    past a few items and 3 levels are elided with `...`."""
    return _REPR.repr(value)


def _bounded(text: str, limit: int) -> str:
    text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class APIError(Exception):
    """An error to send to the client as it is: HTTP `status`, a message naming `param`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = _bounded(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else _bounded(param, MAX_PARAM_CHARS)
        self.code = code
        self.headers = headers or {}

    @classmethod
    def invalid(cls, param: str, message: str) -> "APIError":
        """A 400 for field `param`; the message is prefixed with the field name."""
        return cls(400, f"{param}: {message}", param=param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# The `code` of a 400, by the kind of InvalidRequestError (none for the plain one).
_INVALID_CODES: dict[type[InvalidRequestError], str] = {
    PromptTooLongError: "context_length_exceeded",
    TooManyItemsError: "too_many_items",
    TextTooLongError: "text_too_long",
    UnknownDocumentError: "document_not_found",
    UnknownCollectionError: "collection_not_found",
}


def from_invalid(exc: InvalidRequestError) -> APIError:
    """400 naming the request's field, with the code of its kind (403 for a write to a read-only collection)."""
    if isinstance(exc, CollectionReadOnlyError):
        return APIError(403, str(exc), type="permission_error", param=exc.field, code="collection_read_only")
    code = next((code for kind, code in _INVALID_CODES.items() if isinstance(exc, kind)), None)
    return APIError(400, str(exc), param=exc.field, code=code)


def from_queue_full(exc: QueueFullError, retry_after_s: int) -> APIError:
    return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def from_quota(exc: QuotaExceededError, retry_after_s: int) -> APIError:
    """429 for a tenant's limit: `code` names it (tenant_documents, tenant_bytes, tenant_requests)."""
    return APIError(429, f"{exc.limit}: {exc}", type="rate_limit_error", param=exc.limit, code=f"tenant_{exc.limit}",
                    headers={"Retry-After": str(retry_after_s)})


def from_not_ready(exc: NotReadyError, retry_after_s: int) -> APIError:
    return APIError(503, str(exc), type="unavailable_error", code="not_ready", headers={"Retry-After": str(retry_after_s)})


def from_stream_failure(exc: BaseException) -> APIError:
    """What a generation that failed part-way reports in its stream: the request's own error (a 400
    naming the field) or a 500 without internals (the server log has them)."""
    if isinstance(exc, InvalidRequestError):
        return from_invalid(exc)
    return APIError(500, "generation failed; see the server log", type="server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc: tuple) -> str:
    """`("body", "messages", 0, "content")` -> `messages[0].content`; `("body",)` -> `body`.

    Pydantic appends the member tried to the location of a union error (`str`, `list[str]`,
    `function-after[...]`); the path stops there, at the field itself. Keys past 64
    characters (an unknown field's name can be anything) are clipped.
    """
    # Only the first element is the location; a field may itself be called "query" (POST /search).
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc) or list(loc[:1])
    out = ""
    for part in parts:
        if isinstance(part, str) and (part.lower() in _TYPE_TAGS or "[" in part):
            break
        if not isinstance(part, int) and len(str(part)) > 64:
            part = str(part)[:64] + "…"
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def from_validation(exc: RequestValidationError) -> APIError:
    """400 naming the first invalid field; all problems are listed in the message."""
    problems = []
    for err in exc.errors():
        path = field_path(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            problems.append(("body", f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"))
        elif err.get("type") == "missing":
            problems.append((path, "field required"))
        else:
            problems.append((path, err.get("msg", "invalid value")))
    problems = list(dict.fromkeys(problems))  # a union reports once per member
    if not problems:
        return APIError(400, "body: invalid request", param="body")
    first = problems[0][0]
    return APIError(400, "; ".join(f"{p}: {m}" for p, m in problems), param=first)


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into the JSON shape above."""

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left before its body was complete: nothing to answer, nothing went wrong here.
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_invalid(exc).response()

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return from_queue_full(exc, request.app.state.runtime.settings.retry_after_s).response()

    @app.exception_handler(QuotaExceededError)
    async def _quota(request: Request, exc: QuotaExceededError) -> JSONResponse:
        return from_quota(exc, request.app.state.runtime.settings.retry_after_s).response()

    @app.exception_handler(NotReadyError)
    async def _not_ready(request: Request, exc: NotReadyError) -> JSONResponse:
        return from_not_ready(exc, request.app.state.runtime.settings.retry_after_s).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message, param, code = str(exc.detail), None, None
        if exc.status_code == 413:  # middleware.BodyLimit, for a body sent without Content-Length
            message, param, code = f"body: {message}", "body", "body_too_large"
        elif exc.status_code == 408:  # middleware.BodyLimit: the body stopped arriving or was too slow
            message, param, code = f"body: {message}", "body", "body_timeout"
        elif exc.status_code == 400:  # FastAPI's own "There was an error parsing the body"
            message, param = f"body: {message}", "body"
        return APIError(exc.status_code, message, type=kind, param=param, code=code, headers=dict(exc.headers or {})).response()
