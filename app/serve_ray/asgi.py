"""An HTTP request carried between Ray Serve deployments, and serving one with an ASGI app.

    request = ForwardedRequest.from_scope(scope, body, routing_keys)   # in the ingress
    async for part in serve_asgi(app, request): ...                    # in a replica
    # parts: {"status": 200, "headers": [(b"content-type", b"...")]} once, then {"body": b"..."}

The response comes back part by part as the app sends it, so SSE streams stay streams; parts
that are ready together travel together. When the
consumer stops early (the client went away: Ray cancels the replica's generator), the app's
`receive` answers `http.disconnect`, as a server would, and the app is cancelled if it does
not finish on its own within `DISCONNECT_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

DISCONNECT_GRACE_S = 2.0
REPLICA_HEADER = b"x-hypic-replica"
"""On a response: the replica that served it. On a request: serve it there (if that replica exists)."""


@dataclass(frozen=True)
class ForwardedRequest:
    """One whole HTTP request (its body read) and the routing keys of its chunks."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"
    routing_keys: tuple[str, ...] = field(default=())
    replica: str | None = None  # the replica asked for by name (`X-Hypic-Replica` request header), if any

    @classmethod
    def from_scope(cls, scope: dict, body: bytes, routing_keys: tuple[str, ...] = ()) -> "ForwardedRequest":
        client = scope.get("client")
        headers = tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ()))
        replica = next((v.decode("latin-1").strip() for k, v in headers if k.lower() == REPLICA_HEADER), None)
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), headers, body,
                   tuple(client) if client else None, scope.get("scheme", "http"), scope.get("http_version", "1.1"),
                   routing_keys, replica or None)

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": self.http_version,
                "method": self.method, "scheme": self.scheme, "path": self.path, "raw_path": self.path.encode("utf-8"),
                "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": None, "state": {}}


async def serve_asgi(app, request: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> AsyncIterator[dict]:
    """Run `request` through the ASGI `app`; yield the response start (status, headers +
    `extra_headers`) and then each non-empty body part. Raises what the app raises before it
    started a response; an app that ends without one is a RuntimeError."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    done = object()
    task = asyncio.create_task(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(done))
    finished = started = False
    try:
        while True:
            message = await messages.get()
            if message is done:
                if task.exception() is not None:
                    raise task.exception()
                if not started:
                    raise RuntimeError("the app ended without a response")
                break  # the app returned without a final body message: end the response here
            if message["type"] == "http.response.start":
                started = True
                yield {"status": message["status"], "headers": [*message.get("headers", ()), *extra_headers]}
            elif message["type"] == "http.response.body":
                body, more = bytes(message.get("body", b"")), message.get("more_body", False)
                # Parts the app has already sent go as one: each part costs a message between
                # processes, so a fast stream must not be sent token by token.
                while more and not messages.empty():
                    following = messages.get_nowait()
                    if following is done or following["type"] != "http.response.body":
                        messages.put_nowait(following)  # only `done` can follow a body part, and nothing follows it
                        break
                    body += following.get("body", b"")
                    more = following.get("more_body", False)
                if body:
                    yield {"body": body}
                if not more:
                    break
        finished = True
    finally:
        disconnected.set()
        if not finished and not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            task.cancel()
