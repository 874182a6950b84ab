"""Keep-alive comments in event streams, and the one JSON log stream `logs.configure` sets up."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import warnings

import pytest

from app.service import logs

from app.http import sse


async def _slow(events: list[str], pause: float, closed: list[str]):
    try:
        for e in events:
            await asyncio.sleep(pause)
            yield e
    finally:
        closed.append("closed")


def test_keepalive_fills_silences_and_keeps_every_message():
    async def run():
        closed: list[str] = []
        out = [m async for m in sse.with_keepalive(_slow(["a", "b"], 0.25, closed), 0.1)]
        return out, closed

    out, closed = asyncio.run(run())
    assert [m for m in out if m != sse.KEEPALIVE] == ["a", "b"]
    assert out.count(sse.KEEPALIVE) >= 2 and closed == ["closed"]
    assert list(sse.parse("".join(out).split("\n"))) == []  # comments and bare data strings carry no events


def test_closing_the_stream_while_it_waits_stops_the_source():
    async def run():
        closed: list[str] = []
        stream = sse.with_keepalive(_slow(["a", "b"], 10.0, closed), 0.05)
        assert await stream.__anext__() == sse.KEEPALIVE
        await stream.aclose()  # a client disconnect
        await asyncio.sleep(0.01)
        return closed

    assert asyncio.run(run()) == ["closed"]


def test_event_ids():
    assert sse.event("delta", {"text": "x"}, 3) == 'event: delta\nid: 3\ndata: {"text":"x"}\n\n'
    assert sse.event(None, "[DONE]") == "data: [DONE]\n\n"


@pytest.fixture()
def restore_logging():
    names = ("", *logs.OWN_LOGGERS, "transformers", "py.warnings")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names}
    yield
    logging.captureWarnings(False)
    for n, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)
    from transformers.utils import logging as hf_logging

    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()
    hf_logging.enable_progress_bar()


def test_engine_retrieval_library_and_warning_records_are_json_lines(restore_logging):
    from transformers.utils import logging as hf_logging

    stream = io.StringIO()
    logs.configure("info", stream)
    token = logs.request_id.set("req-1")
    try:
        logging.getLogger("hypic_core.cache.disk").warning("disk cache failed")
        logging.getLogger("retrieval.index").info("saved")
        hf_logging.get_logger("transformers.modeling_utils").warning("falling back")
        logging.getLogger("some.library").info("chatter")  # below warning: dropped
        warnings.warn("deprecated thing", DeprecationWarning)
    finally:
        logs.request_id.reset(token)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["logger"], r["msg"]) for r in lines[:3]] == [("hypic_core.cache.disk", "disk cache failed"), ("retrieval.index", "saved"),
                                                           ("transformers.modeling_utils", "falling back")]
    assert all(r["request_id"] == "req-1" for r in lines)
    assert lines[3]["logger"] == "py.warnings" and "deprecated thing" in lines[3]["msg"] and len(lines) == 4
    assert not hf_logging.is_progress_bar_enabled()
