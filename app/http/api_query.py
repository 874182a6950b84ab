"""POST /query (and GET /query): retrieve, build segments (system prompt, chunks, question),
stitched prefill, answer.

Non-streaming: `{answer, finish_reason, sources, dropped_chunks, usage, reuse, timings}`. `sources`
lists the retrieved chunks in the prompt, best first; chunks that did not fit the model's
context (with `max_tokens` kept for the answer) are left out, lowest-ranked first, and counted
in `dropped_chunks`.
Streaming (`"stream": true`): SSE named events, numbered by `id:` from 1, in order: `sources`
once (`{sources, dropped_chunks}`), `delta` per token batch (`{"text": ...}`), `done`
(`{finish_reason, usage, reuse, timings}`; `reuse`: what the prefill did with each source's tokens). An error after the stream started is sent as a `failure`
event (`{"error": {...}}`; not `error`, the name a browser's EventSource gives its own
connection errors) and the stream ends. `: keep-alive` comments fill silences longer than
`sse_keepalive_s`. Every check that can fail (fields, document ids, prompt length, queue) runs
before the first byte, as a 4xx.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from hypic_core.config import MAX_SEED

from ..service import pipeline

from ..service.engine_thread import TokenStream
from ..service.prompter import Prompt
from ..service.runtime import Runtime
from . import schemas, sse
from .errors import from_stream_failure
from .generation import CacheOptions, SamplingExtras, collect
from .tenancy import tenant_of
from .routing import StrictJSONRoute

log = logging.getLogger("hypic.query")
router = APIRouter(route_class=StrictJSONRoute)
ANSWER = dict(response_model=schemas.QueryResponse, response_model_exclude_unset=True,
              responses={200: {"content": schemas.QUERY_STREAM}} | schemas.errors(400, 413, 429, 503))


class QueryRequest(SamplingExtras):
    """The sampling extras come from `SamplingExtras`; vLLM's sampling `top_k` is not offered
    (`top_k` counts retrieved chunks here)."""

    model_config = ConfigDict(extra="forbid")

    question: str = Field(description="The question; retrieval searches with it.")
    top_k: int | None = Field(None, ge=1, description="Chunks to retrieve (default: settings.default_top_k).")
    document_ids: list[str] | None = Field(None, description="Only retrieve from these documents.")
    collections: list[str] | None = Field(None, description="Retrieve from these collections of this key's tenant "
                                          "(default: its 'default').")
    cache: CacheOptions | None = Field(None, description='{"store": false}: keep nothing of this request in the cache.')
    speculation: bool | None = Field(None, description="Speculative decoding with drafts looked up in the prompt (answers "
                                     "copied from the documents come several tokens a step); null: the gateway's "
                                     "setting (HYPIC_SPECULATION). Greedy answers are the same either way.")
    mode: str | None = Field(None, description="full, prefix, pic-naive or hypic (default: settings.default_mode).")
    seam: int | None = Field(None, ge=0, description="Seam width in tokens (default: the engine's).")
    recompute: float | None = Field(None, ge=0.0, le=1.0, description="Query-aware recompute budget: this share of the "
                                    "reused tokens recomputed in context, on the documents nearest the question (default: "
                                    "HYPIC_RECOMPUTE_RATIO).")
    exact: bool = Field(False, description="Exact reuse only: prefix mode (or full when named); 400 with an approximate mode.")
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed for sampling, 0..2**64-1: the same seed, same answer.")
    stream: bool = False

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("empty", "must not be empty")
        return value

    @field_validator("mode")
    @classmethod
    def _mode_named(cls, value: str | None) -> str | None:
        return mode_named(value)


def mode_named(value: str | None) -> str | None:
    """A request's `mode` as given; an empty one is refused (leave the field out for the default mode)."""
    if value is not None and not value.strip():
        raise PydanticCustomError("empty", "must not be empty: full, prefix, pic-naive or hypic, or leave it out "
                                           "for the default")
    return value


class QueryParams(QueryRequest):
    """GET /query takes the same fields as query parameters (`document_ids` repeated) and
    streams by default, so a browser `EventSource` can read it. Query parameters are text, so
    they are converted (lax): `max_tokens=5`, `stream=false`."""

    model_config = ConfigDict(strict=False)

    stream: bool = True


@router.post("/query", **ANSWER)
async def query(body: QueryRequest, request: Request):
    return await _answer(body, request)


@router.get("/query", **ANSWER)
async def query_get(params: Annotated[QueryParams, Query()], request: Request):
    return await _answer(params, request)


async def _answer(body: QueryRequest, request: Request):
    started = time.perf_counter()
    rt: Runtime = request.app.state.runtime
    rt.require_ready()
    pipeline.require_room(rt)
    pipeline.check_text(rt, [("question", body.question)])
    tenant = tenant_of(request)
    found = await pipeline.retrieve(rt, body.question, body.top_k or rt.settings.default_top_k, body.document_ids,
                                    tenant=tenant, collections=body.collections)
    prompt = await pipeline.off_loop(lambda: rt.prompter.query(body.question, found.hits, reserve=body.max_tokens))
    # The prompt holds the deployment's system prompt, the chunks and the question: over shared
    # collections only, nothing in its cached segments is the tenant's, so the shared salt serves.
    salt = rt.collections.salt(tenant, pipeline.collection_names(body.collections))
    gen = pipeline.generation_request(rt, prompt.segments, body.mode, body.seam, body.exact, prompt.exact_prefix,
                                      cache_salt=salt, cache_store=body.cache is None or body.cache.store,
                                      speculation=body.speculation, recompute=body.recompute, max_tokens=body.max_tokens,
                                      temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                      **body.extras())
    stream = pipeline.start(rt, gen, started, "/query", tenant)
    sources = pipeline.sources(prompt)
    if body.stream:
        return sse.response(_events(stream, sources, found.ms, prompt), rt.settings.sse_keepalive_s)
    events = await collect(stream, request)
    return {"answer": "".join(e.text for e in events), "finish_reason": events[-1].finish_reason} | sources | {
        "usage": pipeline.usage(stream), "reuse": reuse(stream, prompt), "timings": _timings(stream, found.ms)}


def reuse(stream: TokenStream, prompt: Prompt) -> list[dict]:
    """What the prefill did with each source's tokens, in `sources` order: `how` ("composed": its
    cached entry reused wherever it landed, "exact": restored from an exact snapshot, "computed":
    no reuse), `tokens` (the chunk's segment), `reused`, `seam` (recomputed in context) and
    `computed` (the rest, computed for this request); `PrefillStats.segments` per source."""
    done = stream.stats.segments if stream.stats else []
    uses = [done[place] if place < len(done) else None for place in prompt.places]
    return [{"chunk_id": hit.chunk.chunk_id, "how": use.how, "tokens": use.tokens, "reused": use.reused, "seam": use.seam,
             "computed": use.computed} for hit, use in zip(prompt.used, uses) if use is not None]


async def _events(stream: TokenStream, sources: dict, retrieval_ms: float, prompt: Prompt):
    ids = itertools.count(1)
    yield sse.event("sources", sources, next(ids))
    finish = None
    try:
        async for batch in stream.batches():
            text = "".join(e.text for e in batch)
            if text:
                yield sse.event("delta", {"text": text}, next(ids))
            finish = batch[-1].finish_reason or finish
    except Exception as exc:
        error = from_stream_failure(exc)
        log.warning("stream failed", extra={"error": repr(exc)})
        yield sse.event("failure", error.body(), next(ids))
        return
    yield sse.event("done", {"finish_reason": finish, "usage": pipeline.usage(stream), "reuse": reuse(stream, prompt),
                             "timings": _timings(stream, retrieval_ms)}, next(ids))


def _timings(stream: TokenStream, retrieval_ms: float) -> dict:
    prefill_ms = stream.stats.timings_ms.get("prefill") if stream.stats else None
    ttft_ms = pipeline.ms_since(stream.started, stream.first_token_at) if stream.first_token_at else None
    return {"retrieval_ms": retrieval_ms, "prefill_ms": prefill_ms, "ttft_ms": ttft_ms,
            "total_ms": pipeline.ms_since(stream.started)}
