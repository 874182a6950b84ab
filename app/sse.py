"""Server-sent events framing and the streaming response that carries them."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: dict | str) -> str:
    """One SSE message: an optional `event:` line and one `data:` line (JSON unless a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"


def response(messages: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(messages, media_type="text/event-stream", headers=SSE_HEADERS)
