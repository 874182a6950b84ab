"""Server-sent events: framing, the streaming response that carries them, and a parser for clients."""

from __future__ import annotations

import json
from typing import AsyncIterator, Iterable, Iterator

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: dict | str) -> str:
    """One SSE message: an optional `event:` line and one `data:` line (JSON unless a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"


def response(messages: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(messages, media_type="text/event-stream", headers=SSE_HEADERS)


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
