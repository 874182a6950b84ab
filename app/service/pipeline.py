"""The steps every generating endpoint shares: retrieve, build and check the request, start it.

Refusals are domain errors (app/service/errors.py): `InvalidRequestError`s naming the request field
(`field` prefixes such as "rag." let the OpenAI endpoints name their nested fields), so nothing
invalid reaches the engine thread, `QueueFullError` when it is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import anyio

from hypic_core.config import GenerationRequest, Mode, SamplingParams
from hypic_core.errors import InvalidRequestError
from retrieval.document import normalize_document_id
from retrieval.errors import DocumentNotFoundError, RetrievalError
from retrieval.index import SearchHit

from .engine_thread import TokenStream
from .errors import QueueFullError, TextTooLongError, TooManyItemsError, UnknownDocumentError
from .guard import exact_mode
from .prompter import Prompt
from .runtime import Runtime
from .tenants import DEFAULT_COLLECTION, DEFAULT_TENANT, MAX_COLLECTIONS, check_collection_name


@dataclass(frozen=True)
class Retrieval:
    hits: list[SearchHit]
    ms: float


async def retrieve(rt: Runtime, query: str, top_k: int, document_ids: Sequence[str] | None, prefix: str = "",
                   tenant: str = DEFAULT_TENANT, collections: Sequence[str] | None = None) -> Retrieval:
    """The `top_k` chunks closest to `query` in `tenant`'s `collections` (default: its 'default'),
    only from `document_ids` when given, searched on a thread. Raises `InvalidRequestError` for
    top_k above `max_top_k`, more than `max_document_ids` document ids, an unknown or invalid one
    or collection, or bad retrieval input."""
    if top_k > rt.settings.max_top_k:
        raise InvalidRequestError(f"{prefix}top_k", f"must be <= {rt.settings.max_top_k}, got {top_k}")
    if document_ids is not None:
        check_count(f"{prefix}document_ids", document_ids, rt.settings.max_document_ids, "HYPIC_MAX_DOCUMENT_IDS")
        document_ids = [document_id(d, f"{prefix}document_ids") for d in document_ids]
    names = collection_names(collections, f"{prefix}collections")
    started = time.perf_counter()
    try:
        hits = await anyio.to_thread.run_sync(lambda: rt.collections.search(tenant, names, query, top_k, document_ids,
                                                                             f"{prefix}collections"))
    except DocumentNotFoundError as exc:
        raise UnknownDocumentError(f"{prefix}document_ids", str(exc)) from None
    except RetrievalError as exc:
        raise InvalidRequestError("query", str(exc)) from None
    seconds = time.perf_counter() - started
    rt.metrics.retrieval.observe(seconds)
    return Retrieval(hits, round(seconds * 1000.0, 3))


def collection_names(collections: Sequence[str] | None, param: str = "collections") -> list[str]:
    """The collections a request names (default: 'default'), checked and without repeats; `InvalidRequestError` naming `param`."""
    if collections is None:
        return [DEFAULT_COLLECTION]
    if not collections:
        raise InvalidRequestError(param, "must name at least one collection (or be left out: 'default')")
    check_count(param, collections, MAX_COLLECTIONS, "one request's collections")
    return list(dict.fromkeys(check_collection_name(c, f"{param}[{i}]") for i, c in enumerate(collections)))


def utf8_size(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates, refused elsewhere, count as 3)."""
    return len(text.encode("utf-8", "surrogatepass"))


def check_count(param: str, items: Sequence | None, limit: int, setting: str) -> None:
    """`TooManyItemsError` naming `param` when `items` has more than `limit` entries (`setting` names the limit)."""
    if items is not None and len(items) > limit:
        raise TooManyItemsError(param, f"{len(items)} entries, more than the {limit} allowed ({setting})")


def check_text(rt: Runtime, texts: Sequence[tuple[str, str]]) -> None:
    """`TextTooLongError` naming the field where the UTF-8 bytes of `texts` ((param, text) pairs, in request
    order) together pass `max_text_bytes`. Runs before anything is tokenized, so that no
    request makes the gateway tokenize more than the limit."""
    limit, total = rt.settings.max_text_bytes, 0
    for param, text in texts:
        total += utf8_size(text)
        if total > limit:
            raise TextTooLongError(param, f"the request's text passes {limit} bytes here (HYPIC_MAX_TEXT_BYTES, the question "
                                          "or prompt, messages and segments together); shorten it")


def check_stops(rt: Runtime, stops: Sequence[str], param: str = "stop") -> None:
    """`TooManyItemsError` naming `param` for more than `max_stop_strings` stop strings or more than
    `max_stop_bytes` of them together: each generated token is checked against every one."""
    check_count(param, stops, rt.settings.max_stop_strings, "HYPIC_MAX_STOP_STRINGS")
    size = sum(map(utf8_size, stops))
    if size > rt.settings.max_stop_bytes:
        raise TooManyItemsError(param, f"{size} bytes of stop strings, more than the {rt.settings.max_stop_bytes} allowed "
                                       "(HYPIC_MAX_STOP_BYTES)")


async def off_loop(function, *args):
    """`function(*args)` on a thread of anyio's pool (tokenizing, chat templates): the event loop keeps
    answering /health and streaming other requests meanwhile. Its exceptions are raised here."""
    return await anyio.to_thread.run_sync(function, *args)


def document_id(value: str, param: str) -> str:
    """A document id from a request as the index keeps it (`normalize_document_id`: NFC, at
    most 256 characters); `InvalidRequestError` naming `param` if it cannot be one."""
    try:
        return normalize_document_id(value)
    except RetrievalError as exc:
        raise InvalidRequestError(param, str(exc)) from None


def sources(prompt: Prompt) -> dict:
    """The retrieved chunks a prompt holds (best first) and how many did not fit."""
    return {"sources": [{"chunk_id": h.chunk.chunk_id, "document_id": h.chunk.document_id, "title": h.chunk.title,
                         "score": round(h.score, 6), "text": h.chunk.text,
                         "collection": getattr(h, "collection", DEFAULT_COLLECTION)} for h in prompt.used],
            "dropped_chunks": prompt.dropped}


def generation_request(rt: Runtime, segments: Sequence[tuple[int, ...]], mode: str | None, seam: int | None,
                       exact: bool = False, exact_prefix: int = 0, cache_salt: str = "", cache_store: bool = True,
                       speculation: bool | None = None, recompute: float | None = None, **sampling) -> GenerationRequest:
    """An engine request; `sampling` are `SamplingParams` fields. Raises `InvalidRequestError` for max_tokens above
    `max_new_tokens`, an unknown mode, `exact` with an approximate mode and sampling values out
    of range; what depends on the model (token ids, the prompt's length) is checked once, by the
    engine, in `start`.

    A request that names none of `mode`, `seam` and `recompute` (nor `exact`) runs as the accuracy
    guard chooses now (app/service/guard.py: the configured default, a wider seam and recompute
    budget, or `prefix`); one that names any gets what it named, the configured default for the others. `exact` means
    `prefix`, or `full` when named. `cache_salt` is the tenant's (app/service/tenants.py), never
    the client's; `cache_store` False keeps nothing of the request in the cache."""
    if sampling.get("max_tokens", 1) > rt.settings.max_new_tokens:
        raise InvalidRequestError("max_tokens", f"must be <= {rt.settings.max_new_tokens}, got {sampling['max_tokens']}")
    if exact:
        mode = exact_mode(mode)
    elif mode is None and seam is None and recompute is None and rt.guard is not None:
        mode, seam, recompute = rt.guard.serving()
    return GenerationRequest(tuple(segments), Mode.parse(mode or rt.settings.default_mode), seam,
                             SamplingParams(**sampling), exact_prefix=exact_prefix, cache_salt=cache_salt,
                             cache_store=cache_store, speculation=speculation, recompute=recompute)


def require_room(rt: Runtime) -> None:
    """Refuse early (`QueueFullError`) when the engine thread is full, before retrieval spends work on the request."""
    if not rt.engine_thread.has_room():
        rt.metrics.rejected.inc()
        raise QueueFullError(rt.engine_thread.capacity)


def start(rt: Runtime, request: GenerationRequest, started: float, route: str, tenant: str = DEFAULT_TENANT) -> TokenStream:
    """Admit `request` (of `tenant`) to the engine thread; the engine's `InvalidRequestError` for a request it refuses
    (naming the field), `QueueFullError` when the queue is full."""
    stream = rt.engine_thread.submit(rt.engine, request, started, route, rt.tenant_labels(tenant))
    if rt.guard is not None:
        rt.guard.offer(request)  # maybe a shadow check, run once the engine is idle
    return stream


def usage(stream: TokenStream) -> dict:
    """Token counts of a finished stream. The prompt's tokens split into `cached_tokens` (reused
    exactly: an exact prefix, identical to recomputing them, as OpenAI and vLLM report it),
    `composed_tokens` (segment bodies reused by position-independent composition: approximate),
    `seam_tokens` (recomputed at segment joins) and the rest, computed for this request."""
    stats = stream.stats
    return {"prompt_tokens": stats.prompt_tokens if stats else 0, "completion_tokens": stream.completion_tokens,
            "cached_tokens": stats.exact_tokens if stats else 0, "composed_tokens": stats.composed_tokens if stats else 0,
            "seam_tokens": stats.seam_tokens if stats else 0}


def ms_since(start: float, end: float | None = None) -> float:
    """Milliseconds from `start` to `end` (default: now), both `time.perf_counter()` values."""
    return round(((time.perf_counter() if end is None else end) - start) * 1000.0, 3)
