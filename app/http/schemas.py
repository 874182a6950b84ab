"""The gateway's OpenAPI document: response models, error responses and request bodies the
handlers read by hand.

The handlers build plain dicts; the models here describe them. Routes attach them with
`response_model=` and `response_model_exclude_unset=True`, so a response carries exactly the
keys its handler returned (an OpenAI response without `rag` has no `sources` key, not a null
one), and every model allows extra keys, so a handler adding a field never loses it. A handler
that returns a `Response` itself (SSE streams, /ready) is not touched; its shapes are described
in `responses=`, a stream event by event (`sse`). The models cost ~25 us per /query response
(less than the `jsonable_encoder` they replace) and ~2 ms per 1000-document page.

Every error has one body, `ErrorResponse` (app/http/errors.py). `errors(400, 429)` gives the
`responses=` entries for a route; the gateway answers validation errors with 400, so the 422
FastAPI documents by default is removed from the document (`openapi`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema, models_json_schema


class _Open(BaseModel):
    """A response object: keys the model does not name pass through."""

    model_config = ConfigDict(extra="allow")


# --- errors ------------------------------------------------------------------------------
class ErrorDetail(_Open):
    message: str = Field(description="Starts with the offending field when there is one: 'top_k: must be <= 32'.")
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_error, unavailable_error, "
                                  "authentication_error or server_error.")
    param: str | None = Field(description="The request field at fault (`messages[0].content`, `body[2].text`), if any.")
    code: str | None = Field(description="A machine-readable code (`context_length_exceeded`, `queue_full`, ...), if any.")


class ErrorResponse(_Open):
    """The body of every error response (OpenAI's shape)."""

    error: ErrorDetail


_ERRORS = {
    400: "Invalid request: a field is missing, malformed or out of range; `error.param` names it.",
    401: "Missing or wrong API key (only when the server has one).",
    403: "A write from a page on another origin, or a text/plain body without X-Requested-With (only without an API key); "
         "a write to a shared collection the key's tenant only reads.",
    408: "The request's head or body did not arrive in time.",
    431: "Too many header fields, or too many bytes of them.",
    404: "Not found: an unknown document id or model.",
    413: "The request body exceeds the server's limit.",
    415: "Unsupported Content-Type.",
    429: "The request queue is full, or a tenant's quota (documents, bytes, requests in flight) is reached; retry after "
         "Retry-After seconds.",
    503: "The model and index are still loading (or failed to load); retry after Retry-After seconds.",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                                "schema": {"type": "integer"}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the error statuses a route can answer with."""
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} | ({"headers": RETRY_AFTER} if code in (429, 503) else {})
            for code in codes}


# --- generation: shared ------------------------------------------------------------------
class Source(_Open):
    """A retrieved chunk the prompt held."""

    chunk_id: str
    document_id: str
    title: str
    score: float
    text: str
    collection: str = Field("default", description="The collection it is in (app/service/tenants.py).")


REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(*models: type[BaseModel]) -> dict[str, Any]:
    """An SSE `data` field holding the JSON of one of `models`."""
    refs = [_ref(m) for m in models]
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}


def sse(description: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The `content` entry of a 200 that is a server-sent-event stream with `stream: true`.
    Before OpenAPI 3.2 (FastAPI writes 3.1) a stream's `schema` describes each of its events:
    `{event, data, id?, retry?}`, `event` being "message" when the server names none."""
    return {"text/event-stream": {"schema": {"description": description, "anyOf": events}}}


def _event(name: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["event", "data"], "properties": {"event": {"const": name}, "data": data}}


# --- /query ------------------------------------------------------------------------------
class QueryUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="Prompt tokens reused exactly: an exact prefix (system prompt, earlier turns) "
                               "restored from a snapshot.")
    composed_tokens: int = Field(description="Prompt tokens reused by position-independent composition (chunk bodies; "
                                 "approximate).")
    seam_tokens: int = Field(description="Tokens recomputed at segment seams.")


class ChunkReuse(_Open):
    """What the prefill did with one source's tokens (`tokens` = `reused` + `seam` + `computed`)."""

    chunk_id: str
    how: Literal["composed", "exact", "computed"] = Field(description="composed: its cached entry reused where it landed "
                                                          "(approximate); exact: restored from an exact snapshot; computed: "
                                                          "no reuse (first sighting, or a mode that reuses nothing here).")
    tokens: int = Field(description="The chunk's tokens in the prompt.")
    reused: int = Field(description="Tokens reused from the cache (composed or exact).")
    seam: int = Field(description="Tokens recomputed in context at the chunk's start.")
    computed: int = Field(description="The rest, computed for this request.")


class QueryTimings(_Open):
    retrieval_ms: float
    prefill_ms: float | None
    ttft_ms: float | None
    total_ms: float


class QueryResponse(_Open):
    answer: str
    finish_reason: str | None = Field(description="stop, length or abort.")
    sources: list[Source] = Field(description="The retrieved chunks in the prompt, best first.")
    dropped_chunks: int = Field(description="Retrieved chunks left out because they did not fit the context.")
    usage: QueryUsage
    reuse: list[ChunkReuse] = Field(description="Per source, in `sources` order: how its tokens were done.")
    timings: QueryTimings


class QuerySourcesEvent(_Open):
    sources: list[Source]
    dropped_chunks: int


class QueryDeltaEvent(_Open):
    text: str


class QueryDoneEvent(_Open):
    finish_reason: str | None
    usage: QueryUsage
    reuse: list[ChunkReuse] = Field(description="Per source, in `sources` order: how its tokens were done.")
    timings: QueryTimings


QUERY_STREAM = sse("Named events, in order: `sources` once, `delta` per token batch, `done`; or an `error` event "
                   "and the end of the stream.",
                   [_event("sources", _json(QuerySourcesEvent)), _event("delta", _json(QueryDeltaEvent)),
                    _event("done", _json(QueryDoneEvent)), _event("error", _json(ErrorResponse))])


# --- OpenAI ------------------------------------------------------------------------------
class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(description="The model's context, in tokens.")


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(_Open):
    cached_tokens: int = Field(description="Prompt tokens reused exactly (an exact prefix).")
    composed_tokens: int = Field(description="Prompt tokens reused by position-independent composition (approximate).")
    seam_tokens: int = Field(description="Prompt tokens recomputed at segment seams.")


class CompletionUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: list[TokenLogprob] | None


# Only with `rag` (absent otherwise: routes serialize with exclude_unset).
RAG_SOURCES = "With `rag`: the retrieved chunks in the prompt, best first."
RAG_DROPPED = "With `rag`: retrieved chunks that did not fit the context."


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    sources: list[Source] | SkipJsonSchema[None] = Field(None, description=RAG_SOURCES)
    dropped_chunks: int | SkipJsonSchema[None] = Field(None, description=RAG_DROPPED)


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    sources: list[Source] | SkipJsonSchema[None] = Field(None, description=RAG_SOURCES)
    dropped_chunks: int | SkipJsonSchema[None] = Field(None, description=RAG_DROPPED)


class ChatDelta(_Open):
    role: Literal["assistant"] | SkipJsonSchema[None] = None
    content: str | SkipJsonSchema[None] = None


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta = Field(description="`{role, content: \"\"}` first, then `{content}`, and `{}` with the finish_reason.")
    logprobs: ChatLogprobs | None
    finish_reason: str | None


_USAGE_CHUNK = "With `stream_options.include_usage`: null, and the usage in a last chunk with no choices."


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = Field(None, description=_USAGE_CHUNK)
    sources: list[Source] | SkipJsonSchema[None] = Field(None, description=RAG_SOURCES + " On the first chunk.")
    dropped_chunks: int | SkipJsonSchema[None] = Field(None, description=RAG_DROPPED + " On the first chunk.")


class CompletionChunk(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = Field(None, description=_USAGE_CHUNK)
    sources: list[Source] | SkipJsonSchema[None] = Field(None, description=RAG_SOURCES + " On the first chunk.")
    dropped_chunks: int | SkipJsonSchema[None] = Field(None, description=RAG_DROPPED + " On the first chunk.")


def _openai_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    return sse("OpenAI chunks as unnamed events, an `{error}` object if generation fails, then `data: [DONE]`.",
               [_event("message", {"anyOf": [{"const": "[DONE]"}, _json(chunk, ErrorResponse)]})])


CHAT_STREAM = _openai_stream(ChatCompletionChunk)
COMPLETION_STREAM = _openai_stream(CompletionChunk)
# Models only the SSE streams refer to; `openapi` adds them to the document's components.
STREAM_MODELS = (QuerySourcesEvent, QueryDeltaEvent, QueryDoneEvent, ChatCompletionChunk, CompletionChunk, ErrorResponse)


# --- documents and search ----------------------------------------------------------------
class DocumentIn(_Open):
    """A document in a JSON or JSONL body; an `id` that exists is replaced."""

    id: str = Field(min_length=1, pattern=r"\S")
    text: str = Field(min_length=1, pattern=r"\S")
    title: str = Field("", description="Default: the id (a Markdown or reStructuredText heading for uploaded files).")
    source: str = Field("", description="Where the document came from; default `<request>`.")


_DOCUMENT_IN = DocumentIn.model_json_schema()
_TEXT_BODY = {"schema": {"type": "string", "minLength": 1,
                         "description": "One document; `?id=` is required, `?title=` optional."}}
_JSONL_BODY = {"schema": {"type": "string", "minLength": 1,
                          "description": "One document object (`id`, `text`, `title`?, `source`?) per line."}}
DOCUMENTS_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"anyOf": [_DOCUMENT_IN, {"type": "array", "items": _DOCUMENT_IN, "minItems": 1}]}},
    "application/jsonl": _JSONL_BODY,
    "application/x-ndjson": _JSONL_BODY,
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file"],
        "properties": {
            "file": {"type": "array", "items": {"type": "string", "format": "binary"},
                     "description": "Files read by their names' suffixes: .txt .md .rst .html .htm .jsonl, each maybe .gz."},
            "id": {"type": "string", "description": "The document id of the one text file sent (default: its file name)."},
            "title": {"type": "string", "description": "The title of the one file sent."}}}},
    "text/plain": _TEXT_BODY,
    "text/markdown": _TEXT_BODY,
}}}


class DocumentsAdded(_Open):
    documents: int
    chunks: int
    replaced: int = Field(description="How many of the documents replaced one with the same id.")
    document_ids: list[str]
    seconds: float
    collection: str = Field("default", description="The collection it is in (app/service/tenants.py).")


class DocumentInfo(_Open):
    document_id: str
    title: str
    source: str
    chunks: int
    tokens: int
    ingested_at: float = Field(description="Unix time.")


class DocumentList(_Open):
    object: Literal["list"]
    data: list[DocumentInfo]
    first_id: str | None
    last_id: str | None = Field(description="Pass as `after` for the next page.")
    has_more: bool
    collection: str = Field("default", description="The collection it is in (app/service/tenants.py).")


class ChunkContent(_Open):
    chunk_id: str
    chunk_index: int
    text: str
    tokens: int


class DocumentDetail(DocumentInfo):
    content: list[ChunkContent]


class DocumentDeleted(_Open):
    document_id: str
    deleted: Literal[True]
    chunks: int
    collection: str = Field("default", description="The collection it is in (app/service/tenants.py).")


class SearchHit(_Open):
    chunk_id: str
    document_id: str
    title: str
    source: str
    chunk_index: int
    text: str
    tokens: int
    score: float
    collection: str = Field("default", description="The collection it is in (app/service/tenants.py).")


class SearchResult(_Open):
    object: Literal["list"]
    query: str
    retrieval_ms: float
    data: list[SearchHit]


class CollectionInfo(_Open):
    name: str
    shared: bool = Field(description="Read by every tenant (HYPIC_SHARED_COLLECTIONS).")
    writable: bool = Field(description="Whether this key's tenant may add and delete its documents.")
    documents: int
    bytes: int = Field(description="UTF-8 bytes of its chunks' text.")


class CollectionList(_Open):
    object: Literal["list"]
    tenant: str = Field(description="The tenant this key opens.")
    data: list[CollectionInfo]
    quota: dict = Field(description="The tenant's limits (0: none) and what it uses: documents, bytes, requests.")


# --- operations --------------------------------------------------------------------------
class Health(_Open):
    status: Literal["ok"]
    guard: dict | None = Field(None, description="The accuracy guard's state (docs/api.md, accuracy guard); null until loaded.")
    kernels: dict | None = Field(None, description="The native decode kernels of this process: state (loaded, unavailable, "
                                "not loaded), variant, best_variant, pinned (HYPIC_KERNEL_VARIANT), library, sha256, reason (why torch's ops run).")


class Ready(_Open):
    status: Literal["ready"]
    model: str
    chunks: int


class NotReady(_Open):
    status: Literal["loading", "failed"]
    error: str | None = Field(None, description="Why loading failed.")


NOT_READY = {503: {"model": NotReady, "description": "Loading, or loading failed.", "headers": RETRY_AFTER}}
METRICS = {200: {"description": "Prometheus text exposition.",
                 "content": {"text/plain": {"schema": {"type": "string"}}}}}


# --- the document ------------------------------------------------------------------------
def openapi(app: FastAPI, secured: bool = False, open_paths: tuple[str, ...] = ()) -> dict[str, Any]:
    """`app`'s OpenAPI document (built once): FastAPI's, without the 422 responses it adds to
    every route with parameters (the gateway answers validation errors with 400), with the
    models of the SSE events; `secured` (the server has an API key) adds the bearer scheme and
    the 401 to every operation outside `open_paths`."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        def documented(code: int) -> dict[str, Any]:
            response = errors(code)[code] | {"content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            response.pop("model")
            return response

        for path, operations in doc.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for code in (408, 431):  # connection limits (app/http/connections.py, middleware.HeaderLimit): any route
                    responses.setdefault(str(code), documented(code))
                if method in ("post", "put", "patch", "delete") and not secured:  # middleware.OriginCheck
                    responses.setdefault("403", documented(403))
                if secured and path not in open_paths:
                    operation["security"] = [{"bearer": []}]
                    responses["401"] = documented(401)
        components = doc.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _, defs = models_json_schema([(m, "serialization") for m in STREAM_MODELS], ref_template=REF)
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        if secured:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                        "description": "Authorization: Bearer <the server's API key>"}}
        app.openapi_schema = doc
    return app.openapi_schema
