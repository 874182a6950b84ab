"""File formats: how the bytes of a file named `NAME.EXT` (or `NAME.EXT.gz`) become documents.

| suffix | documents | title |
|---|---|---|
| `.txt` | one: the text | the file's stem |
| `.md` | one: the text | a leading `# heading`, else the stem |
| `.rst` | one: the text | the first section title (a line underlined, and maybe overlined, with one punctuation character), else the stem |
| `.html`, `.htm` | one: the visible text, block elements as paragraphs, `<script>`/`<style>` dropped | `<title>`, else the first `<h1>`, else the stem |
| `.jsonl` | one per line: "id" and "text" required, "title" and "source" optional | each line's |

Any of these may be gzip-compressed with `.gz` appended (`notes.md.gz`). Text must be UTF-8
(a byte-order mark is dropped); an HTML page that is not is decoded as its `<meta charset>`
says, else as windows-1252, as browsers do. Used by `retrieval.ingest` for files on disk and by the gateway
for uploaded files, so both read a file the same way.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from html.parser import HTMLParser

from retrieval import strict_json
from retrieval.document import Document, clip, field_problem, normalize_document_id
from retrieval.errors import BinaryInputError, EmptyInputError, InvalidInputError, MalformedItemError, MalformedLineError, UnsupportedFormatError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".html", ".htm")
JSONL_SUFFIX = ".jsonl"
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, JSONL_SUFFIX)
GZIP_SUFFIX = ".gz"
SUPPORTED_DESCRIPTION = f"{', '.join(SUPPORTED_SUFFIXES)} (or any of them + {GZIP_SUFFIX})"


def format_of(name: str) -> tuple[str, bool] | None:
    """(suffix, gzipped) of a file name, e.g. "a.md.gz" -> (".md", True); None if unsupported."""
    lower = name.lower()
    gzipped = lower.endswith(GZIP_SUFFIX)
    if gzipped:
        lower = lower[: -len(GZIP_SUFFIX)]
    for suffix in SUPPORTED_SUFFIXES:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return suffix, gzipped
    return None


def is_supported(name: str) -> bool:
    """Whether `read_documents` reads a file of this name."""
    return format_of(name) is not None


def require_format(name: str, source: str) -> tuple[str, bool]:
    """`format_of(name)`; raises `UnsupportedFormatError` (naming `source`) if it is None."""
    found = format_of(name)
    if found is None:
        raise UnsupportedFormatError(f"{source}: unsupported file type {_suffix(name)!r}; expected one of {SUPPORTED_DESCRIPTION}")
    return found


def read_documents(data: bytes, name: str, document_id: str, source: str, max_bytes: int | None = None) -> list[Document]:
    """The documents in `data`, the content of a file called `name` (its suffix picks the
    format). A text format gives one document, `document_id`; a JSONL file names its own.
    Raises `UnsupportedFormatError` for an unknown suffix, `BinaryInputError` for a corrupt
    gzip stream or non-UTF-8 text, `InvalidInputError` if a gzip file expands beyond
    `max_bytes`, `EmptyInputError` for a file without text, and `parse_jsonl`'s errors."""
    suffix, gzipped = require_format(name, source)
    if gzipped:
        data = gunzip(data, source, max_bytes)
    if suffix == JSONL_SUFFIX:
        return parse_jsonl(data, source)
    text = decode_html(data, source) if suffix in (".html", ".htm") else decode_text(data, source)
    title = ""
    if suffix == ".md":
        title = markdown_title(text)
    elif suffix == ".rst":
        title = rst_title(text)
    elif suffix in (".html", ".htm"):
        text, title = html_text(text)
        if not text.strip():
            raise EmptyInputError(f"{source}: no text outside the HTML markup")
    stem = name.rsplit("/", 1)[-1][: -len(suffix + (GZIP_SUFFIX if gzipped else ""))]
    return [Document(document_id, text, clip(title or stem, "title"), clip(source, "source"))]


def gunzip(data: bytes, source: str, max_bytes: int | None = None) -> bytes:
    """Decompress a gzip file. Raises `BinaryInputError` if it is not valid gzip and
    `InvalidInputError` if it holds more than `max_bytes` bytes (a guard for uploads)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            out = stream.read(-1 if max_bytes is None else max_bytes + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise BinaryInputError(f"{source}: not a valid gzip file ({exc})") from exc
    if max_bytes is not None and len(out) > max_bytes:
        raise InvalidInputError(f"{source}: decompresses to more than {max_bytes} bytes")
    return out


def decode_text(data: str | bytes, source: str) -> str:
    """Return `data` as text. Raises `EmptyInputError` if it is blank and `BinaryInputError`
    if it holds NUL bytes or is not UTF-8 (a UTF-8 byte-order mark is dropped)."""
    if isinstance(data, bytes):
        if b"\x00" in data:
            raise BinaryInputError(f"{source}: binary content (NUL bytes), expected UTF-8 text")
        try:
            data = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise BinaryInputError(f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    if "\x00" in data:
        raise BinaryInputError(f"{source}: binary content (NUL characters), expected text")
    if not data.strip():
        raise EmptyInputError(f"{source}: empty, nothing to ingest")
    return data


_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9._:-]+)""", re.IGNORECASE)


def decode_html(data: bytes, source: str) -> str:
    """An HTML file as text, decoded as a browser would: UTF-8, else the encoding its
    `<meta ... charset=...>` declares in the first 2 KiB, else windows-1252 (HTML's default
    for legacy pages). Raises `decode_text`'s errors (NUL bytes, blank) and
    `BinaryInputError` for a declared encoding that is unknown or does not fit the bytes."""
    try:
        return decode_text(data, source)
    except BinaryInputError:
        if b"\x00" in data:
            raise
    declared = _META_CHARSET.search(data[:2048])
    encoding = declared.group(1).decode("ascii") if declared else "windows-1252"
    try:
        return decode_text(data.decode(encoding, errors="strict" if declared else "replace"), source)
    except (LookupError, UnicodeDecodeError):
        raise BinaryInputError(f"{source}: not UTF-8 text, nor {encoding!r} as its <meta> says") from None


def parse_jsonl(body: str | bytes, source: str = "<request>") -> list[Document]:
    """The documents of a JSONL body, in order. Raises `MalformedLineError` (with the 1-based
    line number) for a line that is not a JSON object with a non-empty string "id" and "text",
    is not JSON `strict_json.loads` accepts (nested too deep, a lone surrogate), or repeats an
    earlier id; `EmptyInputError` if there are no documents."""
    documents: list[Document] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(decode_text(body, source).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = strict_json.loads(line)
        except strict_json.JSONInputError as exc:
            if exc.line is not None:  # a line of JSONL is one line of JSON
                raise MalformedLineError(source, number, f"invalid JSON: {exc.reason.removeprefix('malformed JSON: ')} (column {exc.column})") from exc
            where = f"field {strict_json.format_path(exc.path)!r}: " if exc.path else ""
            raise MalformedLineError(source, number, f"{where}{exc.reason}") from exc
        problem = record_problem(record)
        if problem is not None:
            raise MalformedLineError(source, number, problem[1])
        document = document_from_record(record, source)
        if document.document_id in first_line:
            raise MalformedLineError(source, number, f"duplicate id {document.document_id!r} (first on line {first_line[document.document_id]})")
        first_line[document.document_id] = number
        documents.append(document)
    if not documents:
        raise EmptyInputError(f"{source}: no documents")
    return documents


def parse_json(body: str | bytes, source: str = "<request>") -> list[Document]:
    """The documents of a JSON body: one document object or a list of them (the records of
    `parse_jsonl`). Raises `MalformedItemError` naming the item and field at fault (also for
    JSON `strict_json.loads` refuses, a repeated id or an empty list) and `decode_text`'s errors."""
    try:
        value = strict_json.loads(decode_text(body, source))
    except strict_json.JSONInputError as exc:
        item, field = _item_field(exc.path)
        where = "" if exc.line is None else f" (line {exc.line}, column {exc.column})"
        raise MalformedItemError(source, item, field, exc.reason + where) from exc
    single = isinstance(value, dict)
    records = [value] if single else value
    if not isinstance(records, list):
        raise MalformedItemError(source, None, None, f"expected a document object or a list of them, got {type(value).__name__}")
    if not records:
        raise MalformedItemError(source, None, None, "no documents (an empty list)")
    documents: list[Document] = []
    first_item: dict[str, int] = {}
    for position, record in enumerate(records):
        item = None if single else position
        problem = record_problem(record)
        if problem is not None:
            raise MalformedItemError(source, item, problem[0], problem[1])
        document = document_from_record(record, source)
        if document.document_id in first_item:
            raise MalformedItemError(source, item, "id", f"duplicate id {document.document_id!r} (first in item {first_item[document.document_id]})")
        first_item[document.document_id] = position
        documents.append(document)
    return documents


def _item_field(path: tuple[str | int, ...]) -> tuple[int | None, str | None]:
    """(item, field) of a JSON body's path: `(2, "text")` -> (2, "text"); `("text",)` -> (None, "text")."""
    item = path[0] if path and isinstance(path[0], int) else None
    rest = path[1:] if item is not None else path
    return item, (rest[0] if rest and isinstance(rest[0], str) else None)


def record_problem(record: object) -> tuple[str | None, str] | None:
    """What is wrong with a JSON document record, as (field or None, reason); None if valid:
    an object with non-empty string "id" (one `normalize_document_id` accepts) and "text" and,
    when present, string "title" and "source"."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    for field in ("id", "text"):
        if not isinstance(record.get(field), str) or not record[field].strip():
            return field, f"field {field!r} must be a non-empty string"
    for field in ("title", "source"):
        if not isinstance(record.get(field, ""), str):
            return field, f"field {field!r} must be a string"
        problem = field_problem(field, record.get(field, ""))
        if problem:
            return field, problem
    try:
        normalize_document_id(record["id"])
    except InvalidInputError as exc:
        return "id", str(exc)
    return None


def document_from_record(record: dict, source: str) -> Document:
    """The document of a record that `record_problem` accepts."""
    return Document(record["id"], record["text"], record.get("title", ""), record.get("source") or clip(source, "source"))


def markdown_title(text: str) -> str:
    """The text of the first line if it is a level-1 Markdown heading, else ""."""
    first = text.lstrip().split("\n", 1)[0]
    return first[2:].strip() if first.startswith("# ") else ""


# A reStructuredText adornment: two or more of one punctuation character, nothing else.
_RST_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1+[ \t]*$")


def rst_title(text: str) -> str:
    """The first section title of a reStructuredText document (a non-blank line followed by an
    adornment line at least as long), else ""."""
    lines = text.splitlines()
    for line, under in zip(lines, lines[1:]):
        title = line.strip()
        if title and not _RST_ADORNMENT.match(line.strip()) and _RST_ADORNMENT.match(under) and len(under.rstrip()) >= len(title):
            return title
    return ""


def html_text(html: str) -> tuple[str, str]:
    """(visible text, title) of an HTML page: block elements become paragraphs separated by a
    blank line, `<br>`, list items and table rows become line breaks, whitespace elsewhere is
    collapsed (kept inside `<pre>`); script, style, template, noscript and svg are dropped.
    The title is `<title>`'s text, else the first `<h1>`'s, else ""."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return parser.text(), parser.title()


class _HTMLText(HTMLParser):
    """Collects paragraphs of text; see `html_text`."""

    SKIP = frozenset({"script", "style", "template", "noscript", "svg"})
    BLOCKS = frozenset({
        "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog", "div", "dl", "dt",
        "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hgroup",
        "hr", "html", "legend", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "ul",
    })
    LINES = frozenset({"br", "li", "tr"})
    CELLS = frozenset({"td", "th"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._paragraphs: list[str] = []
        self._current: list[str] = []
        self._skip_depth = 0
        self._pre_depth = 0
        self._in_title = False
        self._title: list[str] = []
        self._h1: list[str] | None = None  # the first h1's text, once it has started
        self._in_h1 = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIP:
            self._skip_depth += 1
        elif tag == "title":
            self._in_title = True
        elif tag in self.BLOCKS:
            self._break()
            self._pre_depth += tag == "pre"
            if tag == "h1" and self._h1 is None:
                self._h1, self._in_h1 = [], True
        elif tag in self.LINES:
            self._current.append("\n")
        elif tag in self.CELLS:
            self._current.append(" ")

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        if tag in self.BLOCKS:
            self._break()
        elif tag in self.LINES:
            self._current.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag == "title":
            self._in_title = False
        elif tag in self.BLOCKS:
            self._break()
            if tag == "pre":
                self._pre_depth = max(0, self._pre_depth - 1)
            if tag == "h1":
                self._in_h1 = False
        elif tag in self.LINES:
            self._current.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        if self._in_title:
            self._title.append(data)
            return
        if self._in_h1 and self._h1 is not None:
            self._h1.append(data)
        self._current.append(data if self._pre_depth else re.sub(r"\s+", " ", data))

    def _break(self) -> None:
        """Close the current paragraph."""
        lines = (line.strip() if not self._pre_depth else line.rstrip() for line in "".join(self._current).split("\n"))
        paragraph = "\n".join(line for line in lines if line.strip())
        if paragraph:
            self._paragraphs.append(paragraph)
        self._current = []

    def text(self) -> str:
        self._break()
        return "\n\n".join(self._paragraphs)

    def title(self) -> str:
        for parts in (self._title, self._h1 or []):
            title = " ".join("".join(parts).split())
            if title:
                return title
        return ""


def _suffix(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return base[base.find("."):] if "." in base else "(none)"
