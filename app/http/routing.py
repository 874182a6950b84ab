"""The route class of every endpoint with a JSON body: the body is parsed by `strict_json`.

    router = APIRouter(route_class=StrictJSONRoute)

FastAPI parses a JSON body with `json.loads`, which lets lone UTF-16 surrogates (`"\\ud800"`)
into every text field (tokenizing or answering with them fails later, as a 500) and answers
over-deep nesting or bytes that are not UTF-8 with a message in another shape. Here the body
is parsed first, once, by `retrieval.strict_json`; what it refuses is a 400 naming the field
(`messages[0].content: contains a lone UTF-16 surrogate ...`) or `body`. FastAPI then reads
the parsed value instead of parsing again.
"""

from __future__ import annotations

import email.message
from typing import Any, Awaitable, Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute

from retrieval import strict_json

from .errors import APIError


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = strict_json.loads(await self.body())
        return self._strict_json


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (`application/json`, `application/*+json`)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def strict_handler(request: Request) -> Response:
            request = StrictJSONRequest(request.scope, request.receive)
            if is_json(request.headers.get("content-type")) and await request.body():
                try:
                    await request.json()
                except strict_json.JSONInputError as exc:
                    param = strict_json.format_path(exc.path)
                    where = "" if exc.line is None else f" (line {exc.line}, column {exc.column})"
                    raise APIError.invalid(param, exc.reason + where) from None
            return await handler(request)

        return strict_handler
