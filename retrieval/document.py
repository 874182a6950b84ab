"""The two records that flow through retrieval: a `Document` to ingest and the `Chunk`s cut from it.

Both are frozen dataclasses validated on construction. A chunk's id is the SHA-256 of its text
only, so the same text always has the same id (and so the same engine cache entry), whichever
document it comes from.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass

from retrieval.errors import EmptyInputError, InvalidInputError
from retrieval.strict_json import lone_surrogate

MAX_DOCUMENT_ID_CHARS = 256
# Every listing of documents and every search hit repeats a document's title and source.
MAX_TITLE_CHARS = 512
MAX_SOURCE_CHARS = 1024
LIMITS = {"title": MAX_TITLE_CHARS, "source": MAX_SOURCE_CHARS}


def chunk_id_for(text: str) -> str:
    """Return the stable id of a chunk text: the hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def clip(value: str, field: str) -> str:
    """A derived `title` or `source` (a Markdown heading, an HTML <title>, an uploaded file's
    name) cut to its limit (`LIMITS`) with a trailing "…"; one a client sets is refused instead."""
    limit = LIMITS[field]
    return value if len(value) <= limit else value[: limit - 1] + "…"


def field_problem(field: str, value: str) -> str | None:
    """Why a client's `title` or `source` cannot be stored, or None: longer than its limit."""
    if len(value) > LIMITS[field]:
        return f"{field} must be at most {LIMITS[field]} characters, got {len(value)}"
    return None


def normalize_document_id(value: str) -> str:
    """A document id as the index keeps it: Unicode NFC, so `café` composed and decomposed
    (as macOS file names are) is one document. Raises `InvalidInputError` for a blank id, one
    longer than `MAX_DOCUMENT_ID_CHARS` or one holding a lone surrogate; the message does not
    repeat a long id."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError("document id must be a non-empty string")
    if lone_surrogate(value) >= 0:
        raise InvalidInputError("document id contains a lone UTF-16 surrogate, which is not valid Unicode text")
    value = unicodedata.normalize("NFC", value)
    if len(value) > MAX_DOCUMENT_ID_CHARS:
        raise InvalidInputError(f"document id must be at most {MAX_DOCUMENT_ID_CHARS} characters, got {len(value)}")
    return value


@dataclass(frozen=True)
class Document:
    """A text to ingest.

    `document_id` names it in the index (normalised by `normalize_document_id`): ingesting
    another document with the same id replaces it. `title` defaults to the id; `source` says
    where it came from (a path, "<request>"). Raises `InvalidInputError` for an id
    `normalize_document_id` refuses, a field holding a lone surrogate or a title or source
    longer than `MAX_TITLE_CHARS` / `MAX_SOURCE_CHARS`, and `EmptyInputError` for blank text.
    """

    document_id: str
    text: str
    title: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "document_id", normalize_document_id(self.document_id))
        if not isinstance(self.text, str) or not self.text.strip():
            raise EmptyInputError(f"document {self.document_id!r} has no text")
        for field in ("text", "title", "source"):
            at = lone_surrogate(getattr(self, field))
            if at >= 0:
                raise InvalidInputError(f"document {self.document_id!r}: {field} has a lone UTF-16 surrogate at character {at}, "
                                        "which is not valid Unicode text")
        for field in LIMITS:
            problem = field_problem(field, getattr(self, field))
            if problem:
                raise InvalidInputError(f"document {self.document_id!r}: {problem}")
        if not self.title:
            object.__setattr__(self, "title", self.document_id)


@dataclass(frozen=True)
class Chunk:
    """A piece of a document small enough to embed and to hand to the engine as one segment.

    `text` is an exact span of the document's text (line endings normalised to "\\n");
    `chunk_id` is `chunk_id_for(text)`; `chunk_index` is its 0-based position in the document;
    `token_count` is its length in the chunker's tokenizer, without special tokens.
    """

    chunk_id: str
    document_id: str
    title: str
    source: str
    chunk_index: int
    text: str
    token_count: int

    @classmethod
    def create(cls, document: Document, chunk_index: int, text: str, token_count: int) -> Chunk:
        """Build the chunk of `document` at `chunk_index`, deriving its id from `text`."""
        return cls(
            chunk_id=chunk_id_for(text),
            document_id=document.document_id,
            title=document.title,
            source=document.source,
            chunk_index=chunk_index,
            text=text,
            token_count=token_count,
        )
