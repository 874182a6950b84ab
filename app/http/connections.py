"""How uvicorn holds connections: its h11 protocol with a deadline on each request's head, and
the uvicorn options the settings give.

    uvicorn.run(app, host=..., port=..., **uvicorn_options(settings))

uvicorn closes a connection that stays idle `keep_alive_timeout_s` after a response, but sets
no deadline on a request's head: a client that opens a connection and sends nothing, or sends a
header line every few seconds (slowloris), holds it forever. `HeadDeadlineProtocol` gives
each request `header_timeout_s` from the connection's start (or the previous response's end)
to deliver its whole head, then answers 408 (or, if nothing came, just closes). The body has
its own idle deadline (`middleware.BodyLimit`); h11 bounds a head arriving in pieces to
`max_header_bytes` (a longer one gets uvicorn's plain-text 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hypic.access")


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"headers: the request head did not arrive within {seconds:g} s",
                                 "type": "invalid_request_error", "param": "headers", "code": "header_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose next request head is not complete
    `head_timeout` seconds after the connection opened or the last response ended."""

    head_timeout: float = 10.0  # set on a subclass by `uvicorn_options`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # Once a head is parsed h11 leaves IDLE; a slow body or a long answer is not this timer's business.
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            log.debug("request head timed out", extra={"client": self.client})
            self.transport.write(_timeout_response(self.head_timeout))
        self.transport.close()


def uvicorn_options(settings) -> dict:
    """`uvicorn.Config` keyword arguments for the connection limits in `settings` (`app.service.settings.Settings`)."""
    protocol = type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": settings.header_timeout_s})
    return {"http": protocol, "timeout_keep_alive": settings.keep_alive_timeout_s,
            "h11_max_incomplete_event_size": settings.max_header_bytes}
