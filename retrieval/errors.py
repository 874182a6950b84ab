"""Exceptions raised by the retrieval package.

Every error the package raises on purpose derives from `RetrievalError`, so a caller (the CLI,
the gateway) can catch one type and show its message. Subclasses also derive from the matching
built-in (`ValueError`, `KeyError`, `FileNotFoundError`) so generic handlers keep working.
An operation that raises one of these leaves the index, in memory and on disk, as it was.
"""

from __future__ import annotations


class RetrievalError(Exception):
    """Base class of every error raised on purpose by `retrieval`."""


class InvalidInputError(RetrievalError, ValueError):
    """A document, file or request body cannot be ingested."""


class EmptyInputError(InvalidInputError):
    """A file or text has no content (zero bytes or only whitespace)."""


class BinaryInputError(InvalidInputError):
    """A file or body is not UTF-8 text (NUL bytes or an invalid encoding)."""


class UnsupportedFormatError(InvalidInputError):
    """A file has an extension the ingester does not read."""


class MalformedLineError(InvalidInputError):
    """One line of a JSONL body is not a valid document; `line_number` is 1-based."""

    def __init__(self, source: str, line_number: int, reason: str) -> None:
        super().__init__(f"{source}: line {line_number}: {reason}")
        self.source = source
        self.line_number = line_number
        self.reason = reason


class MalformedItemError(InvalidInputError):
    """One document of a JSON body is invalid: `item` is its 0-based position in a list (None for
    a single object), `field` the field at fault (None when the item itself is)."""

    def __init__(self, source: str, item: int | None, field: str | None, reason: str) -> None:
        where = "" if item is None else f"item {item}: "
        super().__init__(f"{source}: {where}{reason}")
        self.source = source
        self.item = item
        self.field = field
        self.reason = reason


class InputNotFoundError(InvalidInputError, FileNotFoundError):
    """A path given for ingestion does not exist or holds no readable documents."""


class DimensionMismatchError(RetrievalError, ValueError):
    """Vectors do not have the dimension of the index they are meant for."""


class EmbedderMismatchError(RetrievalError, ValueError):
    """An index built with one embedder is opened with another of the same dimension."""


class IndexCorruptError(RetrievalError):
    """Index files on disk are missing, unreadable or disagree with their manifest."""


class IndexLockedError(RetrievalError):
    """Another process held the index's write lock for longer than the writer would wait;
    `holder` describes it ("pid 4711: hypic serve") when the system can tell."""

    def __init__(self, directory: str, holder: str | None, waited_s: float) -> None:
        by = f"by {holder}" if holder else "by another process"
        super().__init__(f"index {directory} is being written {by}; gave up after waiting {waited_s:g} s for its write lock")
        self.directory = directory
        self.holder = holder
        self.waited_s = waited_s


class DocumentNotFoundError(RetrievalError, KeyError):
    """A document id is not in the index."""

    def __init__(self, document_id: str) -> None:
        super().__init__(document_id)
        self.document_id = document_id

    def __str__(self) -> str:
        return f"document {self.document_id!r} is not in the index"
