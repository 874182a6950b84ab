"""Documents in the vector index: POST /documents, GET /documents, DELETE /documents/{id}.

POST takes the raw body, by Content-Type:
- `application/jsonl` (or `application/x-ndjson`): one JSON object per line with "id" and
  "text" ("title", "source" optional);
- `text/plain` or `text/markdown`: one document; `?id=` is required, `?title=` optional (a
  Markdown `# heading` on the first line is the default title).
A document whose id exists is replaced. Chunking and embedding run on a thread; the whole body
is validated first, so a bad line changes nothing (400 naming the line).
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Query, Request

from retrieval.errors import DocumentNotFoundError, RetrievalError
from retrieval.index import DocumentInfo
from retrieval.ingest import document_from_text, ingest_documents, parse_jsonl

from .errors import APIError
from .runtime import Runtime

router = APIRouter()
JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/json-lines", "application/x-jsonlines")
TEXT_TYPES = ("text/plain", "text/markdown")


@router.post("/documents", status_code=201)
async def add_documents(request: Request, id: str | None = Query(None, description="Document id of a text body."),
                        title: str = Query("", description="Title of a text body.")) -> dict:
    rt = _runtime(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in JSONL_TYPES + TEXT_TYPES:
        raise APIError(415, f"content-type: expected one of {', '.join(JSONL_TYPES + TEXT_TYPES)}, got {content_type or 'none'!r}",
                       param="content-type")
    body = await request.body()
    try:
        if content_type in JSONL_TYPES:
            documents = parse_jsonl(body)
        elif id is None or not id.strip():
            raise APIError.invalid("id", "a text body needs ?id=<document id>")
        else:
            documents = [document_from_text(body, id, title)]
        summary = await anyio.to_thread.run_sync(ingest_documents, documents, rt.index, rt.chunker)
    except RetrievalError as exc:
        raise APIError.invalid("body", str(exc)) from None
    return {"documents": summary.documents, "chunks": summary.chunks, "replaced": summary.replaced,
            "document_ids": [d.document_id for d in documents], "seconds": round(summary.seconds, 3)}


@router.get("/documents")
async def list_documents(request: Request) -> dict:
    rt = _runtime(request)
    docs = await anyio.to_thread.run_sync(rt.index.list_documents)
    return {"object": "list", "data": [_info(d) for d in docs]}


@router.delete("/documents/{document_id:path}")
async def delete_document(document_id: str, request: Request) -> dict:
    rt = _runtime(request)
    try:
        chunks = await anyio.to_thread.run_sync(rt.index.delete_document, document_id)
    except DocumentNotFoundError as exc:
        raise APIError(404, f"document_id: {exc}", type="not_found_error", param="document_id",
                       code="document_not_found") from None
    return {"document_id": document_id, "deleted": True, "chunks": chunks}


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    rt.require_ready()
    return rt


def _info(d: DocumentInfo) -> dict:
    return {"document_id": d.document_id, "title": d.title, "source": d.source, "chunks": d.chunk_count,
            "tokens": d.token_count, "ingested_at": d.ingested_at}
