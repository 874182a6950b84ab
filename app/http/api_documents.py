"""Documents in the vector index, and retrieval without generation.

    POST   /documents              add or replace documents (body by Content-Type, below)
    GET    /documents              a page of documents: ?limit= (1-1000, default 100) &after=<id>
    GET    /documents/{id}         one document, with its chunks
    DELETE /documents/{id}         remove a document, and its chunks' work from the segment cache
    POST   /search                 {"query", "top_k"?, "document_ids"?, "collections"?} -> ranked chunks
    GET    /collections            the collections this key's tenant reads, and its quota

Every route acts on the tenant the request's API key opens (app/service/tenants.py) and on one of
its collections: `?collection=` (default 'default') on the /documents routes, `collections` on
/search. A tenant never sees, changes or searches another tenant's collections; a shared
collection (HYPIC_SHARED_COLLECTIONS) is read by every tenant and written only by those it names
(else 403). An upload past the tenant's document or byte quota is a 429 and changes nothing.
A deleted document's text also leaves the cache: its chunks' segment entries (every tier, every seam
width) and the exact snapshots holding them, under the salts it could be cached under
(app/service/forgetting.py); so do a replaced document's chunks that its new version no longer has.

POST /documents takes, by Content-Type:
- `application/json`: one `{"id", "text", "title"?, "source"?}` object or a list of them;
- `application/jsonl` (or `application/x-ndjson`): one such object per line;
- `multipart/form-data`: files in the repeatable field `file`, read by their names' suffixes as
  `hypic ingest` reads them (`retrieval.formats`: .txt .md .rst .html .htm .jsonl, each maybe
  .gz); a text file's document id is its file name, or the form field `id` (and `title`) when
  one file is sent;
- `text/plain` or `text/markdown`: one document; `?id=` is required, `?title=` optional (a
  Markdown `# heading` on the first line is the default title).
A document whose id exists is replaced. The whole body is read and validated before anything
is chunked, so a bad item changes nothing (400 naming the item and field: `body[2].text`,
`file[1]`); chunking and embedding run on a thread. Ids are kept in Unicode NFC and are at most
256 characters (`retrieval.document.normalize_document_id`); ids in paths, `after` and
`document_ids` are normalised the same way, so either spelling of `café` finds it. A title
is at most 512 characters and a source 1024 (`retrieval.document.LIMITS`): longer ones a client
sends are a 400 naming the field, derived ones (a heading, a file name) are cut. Without an
API key a `text/plain` body also needs `X-Requested-With` (`middleware.OriginCheck`).

The `{document_id:path}` routes match ids with slashes (`notes/readme.md`); no other route may
start with `/documents/`, or they would shadow it.
"""

from __future__ import annotations

import logging
import unicodedata

import anyio
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrieval.document import MAX_DOCUMENT_ID_CHARS, Document, field_problem
from retrieval.errors import DocumentNotFoundError, IndexLockedError, MalformedItemError, RetrievalError
from retrieval.formats import parse_json, parse_jsonl, read_documents
from retrieval.index import DocumentInfo
from retrieval.ingest import document_from_text, ingest_documents
from retrieval.strict_json import lone_surrogate

from ..service import forgetting, pipeline
from ..service.errors import QuotaExceededError
from ..service.tenants import DEFAULT_COLLECTION, check_collection_name

from ..service.runtime import Runtime
from . import schemas
from .errors import APIError
from .routing import StrictJSONRoute
from .tenancy import tenant_of

log = logging.getLogger("hypic.documents")
router = APIRouter(route_class=StrictJSONRoute)
COLLECTION = Query(DEFAULT_COLLECTION, description="The collection of this key's tenant (app/service/tenants.py).")
JSON_TYPES = ("application/json",)
JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/json-lines", "application/x-jsonlines")
MULTIPART_TYPES = ("multipart/form-data",)
TEXT_TYPES = ("text/plain", "text/markdown")
CONTENT_TYPES = JSON_TYPES + JSONL_TYPES + MULTIPART_TYPES + TEXT_TYPES
FORM_FIELDS = ("file", "id", "title")
# An uploaded .gz file may expand to this many times the body limit, no more.
GUNZIP_FACTOR = 16


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    query: str = Field(description="The text to search with.")
    top_k: int | None = Field(None, ge=1, description="Chunks to return (default: settings.default_top_k, at most settings.max_top_k).")
    document_ids: list[str] | None = Field(None, description="Only search these documents.")
    collections: list[str] | None = Field(None, description="Search these collections of this key's tenant "
                                          "(default: its 'default').")

    @field_validator("query")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("empty", "must not be empty")
        return value


@router.post("/documents", status_code=201, response_model=schemas.DocumentsAdded,
             responses=schemas.errors(400, 403, 413, 415, 429, 503), openapi_extra=schemas.DOCUMENTS_BODY)
async def add_documents(request: Request, id: str | None = Query(None, description="Document id of a text body."),
                        title: str = Query("", description="Title of a text body."),
                        collection: str = COLLECTION) -> dict:
    rt = _runtime(request)
    tenant = tenant_of(request)
    check_collection_name(collection, "collection")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in CONTENT_TYPES:
        raise APIError(415, f"content-type: expected one of {', '.join(CONTENT_TYPES)}, got {content_type or 'none'!r}",
                       param="content-type")
    if content_type in MULTIPART_TYPES:
        documents = await _uploaded_documents(request, rt)
    else:
        documents = _body_documents(await request.body(), content_type, id, title)
    try:
        summary = await anyio.to_thread.run_sync(_ingest, rt, tenant, collection, documents)
    except QuotaExceededError as exc:
        rt.metrics.tenant_refused.labels(rt.tenant_labels(tenant), exc.limit).inc()
        raise
    except IndexLockedError as exc:
        raise _locked(rt, exc) from None
    except RetrievalError as exc:
        raise APIError.invalid("body", str(exc)) from None
    if summary.chunks and rt.guard is not None:
        rt.guard.new_corpus()  # check the next requests densely: they may read the new documents
    return {"documents": summary.documents, "chunks": summary.chunks, "replaced": summary.replaced,
            "document_ids": [d.document_id for d in documents], "seconds": round(summary.seconds, 3), "collection": collection}


def _ingest(rt: Runtime, tenant: str, collection: str, documents: list[Document]):
    """Ingest `documents` into `tenant`'s `collection` (created if new), within the tenant's quota
    (checked, under the tenant's upload lock, once the chunks are cut and before anything is written);
    the replaced documents' chunks that are gone leave the cache."""
    index = rt.collections.writable(tenant, collection, "collection")
    before = forgetting.chunks_before(index, [d.document_id for d in documents])  # what replacing them drops
    quotas = rt.quotas
    if not quotas.max_documents and not quotas.max_bytes:
        summary = ingest_documents(documents, index, rt.chunker)
    else:
        with quotas.upload_lock(tenant):
            summary = ingest_documents(documents, index, rt.chunker,
                                       admit=lambda chunks: quotas.admit(rt.collections, tenant, index, chunks))
    if before:
        forgotten = forgetting.forget_replaced(rt, tenant, collection, index, before)
        log.info("%d document(s) of %s/%s replaced; cache entries of their dropped chunks removed %s, exact snapshots %d",
                 len(before), tenant, collection, forgotten.entries, forgotten.snapshots)
    return summary


@router.get("/documents", response_model=schemas.DocumentList, responses=schemas.errors(400, 503))
async def list_documents(request: Request,
                         limit: int = Query(100, ge=1, le=1000, description="Documents per page."),
                         after: str | None = Query(None, description="Return documents whose id sorts after this one (the previous page's last_id)."),
                         collection: str = COLLECTION) -> dict:
    rt = _runtime(request)
    tenant = tenant_of(request)
    check_collection_name(collection, "collection")
    if after is not None and len(after) > MAX_DOCUMENT_ID_CHARS:  # no id sorts between a longer `after` and its prefix
        raise APIError.invalid("after", f"must be at most {MAX_DOCUMENT_ID_CHARS} characters (a document id), got {len(after)}")
    after = None if after is None else unicodedata.normalize("NFC", after)  # ids are kept in NFC
    # One extra row says whether another page follows.
    docs = await anyio.to_thread.run_sync(lambda: rt.collections.get(tenant, collection).list_documents(after=after, limit=limit + 1))
    page = docs[:limit]
    return {"object": "list", "data": [_info(d) for d in page], "first_id": page[0].document_id if page else None,
            "last_id": page[-1].document_id if page else None, "has_more": len(docs) > limit, "collection": collection}


@router.get("/collections", response_model=schemas.CollectionList, responses=schemas.errors(503))
async def list_collections(request: Request) -> dict:
    """The collections this key's tenant reads (its own, then the shared ones), and its quota."""
    rt = _runtime(request)
    tenant = tenant_of(request)

    def describe() -> dict:
        data = []
        for name in rt.collections.names(tenant):
            documents, size = rt.collections.get(tenant, name).usage()
            shared = name in rt.collections.shared
            data.append({"name": name, "shared": shared, "writable": not shared or tenant in rt.collections.shared[name],
                         "documents": documents, "bytes": size})
        documents, size = rt.collections.usage(tenant)
        q = rt.quotas
        quota = {"max_documents": q.max_documents, "max_bytes": q.max_bytes, "max_requests": q.max_requests,
                 "documents": documents, "bytes": size, "requests": q.in_flight(tenant)}
        return {"object": "list", "tenant": tenant, "data": data, "quota": quota}

    return await anyio.to_thread.run_sync(describe)


@router.get("/documents/{document_id:path}", response_model=schemas.DocumentDetail, responses=schemas.errors(400, 404, 503))
async def get_document(document_id: str, request: Request, collection: str = COLLECTION) -> dict:
    rt = _runtime(request)
    tenant = tenant_of(request)
    document_id = pipeline.document_id(document_id, "document_id")
    check_collection_name(collection, "collection")

    def read():
        index = rt.collections.get(tenant, collection)
        return index.document(document_id), index.chunks(document_id)

    try:
        info, chunks = await anyio.to_thread.run_sync(read)
    except DocumentNotFoundError as exc:
        raise _not_found(exc) from None
    return _info(info) | {"content": [{"chunk_id": c.chunk_id, "chunk_index": c.chunk_index, "text": c.text, "tokens": c.token_count}
                                       for c in chunks]}


@router.delete("/documents/{document_id:path}", response_model=schemas.DocumentDeleted, responses=schemas.errors(400, 403, 404, 503))
async def delete_document(document_id: str, request: Request, collection: str = COLLECTION) -> dict:
    rt = _runtime(request)
    tenant = tenant_of(request)
    document_id = pipeline.document_id(document_id, "document_id")
    check_collection_name(collection, "collection")

    def remove() -> int:
        index = rt.collections.writable(tenant, collection, create=False)
        chunks = index.chunks(document_id)
        removed = index.delete_document(document_id)
        forgotten = forgetting.forget_chunks(rt, tenant, collection, chunks)
        log.info("document %r of %s/%s deleted: %d chunks; cache entries removed %s, exact snapshots %d", document_id,
                 tenant, collection, removed, forgotten.entries, forgotten.snapshots)
        return removed

    try:
        chunks = await anyio.to_thread.run_sync(remove)
    except DocumentNotFoundError as exc:
        raise _not_found(exc) from None
    except IndexLockedError as exc:
        raise _locked(rt, exc) from None
    return {"document_id": document_id, "deleted": True, "chunks": chunks, "collection": collection}


@router.post("/search", response_model=schemas.SearchResult, responses=schemas.errors(400, 413, 503))
async def search(body: SearchRequest, request: Request) -> dict:
    """The `top_k` chunks closest to the query, best first; nothing is generated."""
    rt = _runtime(request)
    pipeline.check_text(rt, [("query", body.query)])
    found = await pipeline.retrieve(rt, body.query, body.top_k or rt.settings.default_top_k, body.document_ids,
                                    tenant=tenant_of(request), collections=body.collections)
    return {"object": "list", "query": body.query, "retrieval_ms": found.ms,
            "data": [{"chunk_id": h.chunk.chunk_id, "document_id": h.chunk.document_id, "title": h.chunk.title,
                      "source": h.chunk.source, "chunk_index": h.chunk.chunk_index, "text": h.chunk.text,
                      "tokens": h.chunk.token_count, "score": round(h.score, 6), "collection": h.collection} for h in found.hits]}


def _body_documents(body: bytes, content_type: str, id: str | None, title: str) -> list[Document]:
    """The documents of a JSON, JSONL or text body; 400 naming the item and field at fault."""
    try:
        if content_type in JSON_TYPES:
            return parse_json(body)
        if content_type in JSONL_TYPES:
            return parse_jsonl(body)
        if id is None or not id.strip():
            raise APIError.invalid("id", "a text body needs ?id=<document id>")
        if field_problem("title", title):
            raise APIError.invalid("title", field_problem("title", title))
        return [document_from_text(body, pipeline.document_id(id, "id"), title)]
    except MalformedItemError as exc:
        item = "" if exc.item is None else f"[{exc.item}]"
        param = f"body{item}" + (f".{exc.field}" if exc.field else "")
        raise APIError.invalid(param, exc.reason) from None
    except RetrievalError as exc:
        raise APIError.invalid("body", str(exc)) from None


async def _uploaded_documents(request: Request, rt: Runtime) -> list[Document]:
    """The documents of the files in a multipart body; 400 naming the field or file at fault."""
    try:
        form = await request.form()
    except StarletteHTTPException as exc:  # Starlette's answer to a malformed multipart body
        if exc.status_code != 400:
            raise
        raise APIError.invalid("body", f"malformed multipart body: {exc.detail}") from None
    try:
        return await _read_form(form, rt.settings.max_body_bytes * GUNZIP_FACTOR)
    finally:
        await form.close()


async def _read_form(form: FormData, max_bytes: int) -> list[Document]:
    unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
    if unknown:
        raise APIError.invalid(unknown[0], f"unknown form field; expected {', '.join(FORM_FIELDS)}")
    files = form.getlist("file")
    if not files:
        raise APIError.invalid("file", "no files: send them in the form field 'file'")
    names = {field: form.get(field) for field in ("id", "title")}
    for field, value in names.items():
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise APIError.invalid(field, "must be a non-empty text field")
        if value is not None and len(files) > 1:
            raise APIError.invalid(field, f"names one document, but {len(files)} files were sent")
        if value is not None and lone_surrogate(value) >= 0:  # a multipart body may declare charset=utf-7
            raise APIError.invalid(field, "contains a lone UTF-16 surrogate, which is not valid Unicode text")
        if field == "title" and value is not None and field_problem("title", value):
            raise APIError.invalid(field, field_problem("title", value))
    if names["id"] is not None:
        names["id"] = pipeline.document_id(names["id"], "id")
    documents: list[Document] = []
    first_file: dict[str, int] = {}
    for number, upload in enumerate(files):
        param = f"file[{number}]" if len(files) > 1 else "file"
        if not isinstance(upload, UploadFile) or not upload.filename:
            raise APIError.invalid(param, "expected a file with a file name")
        try:
            read = read_documents(await upload.read(), upload.filename, names["id"] or upload.filename, upload.filename, max_bytes)
        except RetrievalError as exc:
            raise APIError.invalid(param, str(exc)) from None
        if len(read) > 1 and (names["id"] or names["title"]):
            raise APIError.invalid("id" if names["id"] else "title", f"{upload.filename} holds {len(read)} documents with their own ids and titles")
        for document in read:
            if document.document_id in first_file:
                raise APIError.invalid(param, f"{upload.filename}: document id {document.document_id!r} also comes from file[{first_file[document.document_id]}]")
            first_file[document.document_id] = number
            documents.append(Document(document.document_id, document.text, names["title"], document.source) if names["title"] else document)
    return documents


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    rt.require_ready()
    return rt


def _not_found(exc: DocumentNotFoundError) -> APIError:
    return APIError(404, f"document_id: {exc}", type="not_found_error", param="document_id", code="document_not_found")


def _locked(rt: Runtime, exc: IndexLockedError) -> APIError:
    """503: another process (`hypic ingest`) held the index's write lock for the whole wait."""
    return APIError(503, str(exc), type="unavailable_error", code="index_locked", headers={"Retry-After": str(rt.settings.retry_after_s)})


def _info(d: DocumentInfo) -> dict:
    return {"document_id": d.document_id, "title": d.title, "source": d.source, "chunks": d.chunk_count,
            "tokens": d.token_count, "ingested_at": d.ingested_at}
