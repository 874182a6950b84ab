"""Server-sent events: framing, the streaming response that carries them (with keep-alive
comments while nothing else comes), and a parser for clients."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Iterable, Iterator

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = ": keep-alive\n\n"


def event(name: str | None, data: dict | str, id: int | str | None = None) -> str:
    """One SSE message: optional `event:` and `id:` lines and one `data:` line (JSON unless a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + (f"id: {id}\n" if id is not None else "") + f"data: {payload}\n\n"


def response(messages: AsyncIterator[str], keepalive_s: float | None = None) -> StreamingResponse:
    """A `text/event-stream` response of `messages`; with `keepalive_s`, a `: keep-alive`
    comment goes out whenever no message has for that long (clients ignore comments; proxies
    that close quiet connections see traffic)."""
    body = messages if keepalive_s is None else with_keepalive(messages, keepalive_s)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def with_keepalive(messages: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """`messages`, with `KEEPALIVE` after each `interval` seconds without one. Closing this
    generator (a client disconnect) stops `messages` where it waits, running its cleanup."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(messages.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                message = finished.result()
            except StopAsyncIteration:
                return
            yield message
    finally:
        if pending is not None:  # it runs `messages` in its own task: cancelling it ends `messages` there
            pending.cancel()
        else:
            await messages.aclose()


def parse(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(event name, data) for each message of an SSE line stream; the name is "message" when absent.
    Multi-line data is joined with newlines; comments and unknown fields are skipped."""
    name, data = None, []
    for line in lines:
        if not line:
            if data:
                yield name or "message", "\n".join(data)
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield name or "message", "\n".join(data)
