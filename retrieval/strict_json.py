"""JSON from the outside world, parsed with the checks `json.loads` leaves out.

    value = loads(body)            # bytes or str
    except JSONInputError as exc:  exc.path == ("messages", 0, "content"), exc.reason == "..."

`json.loads` accepts what later breaks a server: lone UTF-16 surrogates (`"\\ud800"`, and raw
surrogate bytes, which it decodes with `surrogatepass`) make every UTF-8 encoder (tokenizers,
the JSON response, the index files) raise; nesting a thousand levels deep raises
`RecursionError`; an integer of 5000 digits raises a plain `ValueError`. `loads` refuses
these, and bytes that are not UTF-8, with an error naming
where: `path` is the keys and list positions from the top (empty for the whole body).
Used for the gateway's request bodies and for JSON and JSONL documents.
"""

from __future__ import annotations

import json
import re
from typing import Any

from retrieval.errors import InvalidInputError

MAX_DEPTH = 64
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a lone surrogate gets into valid UTF-8 JSON


class JSONInputError(InvalidInputError):
    """JSON that `loads` refuses: `path` locates the value at fault (keys and list indexes),
    `reason` says why; malformed JSON has the 1-based `line` and `column` where parsing stopped."""

    def __init__(self, path: tuple[str | int, ...], reason: str, line: int | None = None, column: int | None = None) -> None:
        where = "" if line is None else f" (line {line}, column {column})"
        super().__init__(f"{format_path(path, 'JSON')}: {reason}{where}")
        self.path = path
        self.reason = reason
        self.line = line
        self.column = column


def lone_surrogate(text: str) -> int:
    """The index of the first lone UTF-16 surrogate in `text` (not valid Unicode text), or -1."""
    found = _SURROGATE.search(text)
    return -1 if found is None else found.start()


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `data`. Bytes must be UTF-8 (a byte-order mark is dropped). Raises
    `JSONInputError` for bytes that are not UTF-8, malformed JSON, an integer too long to
    convert, nesting deeper than `max_depth` arrays and objects, or a string or object key
    holding a lone surrogate."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise JSONInputError((), f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise JSONInputError((), f"malformed JSON: {exc.msg}", exc.lineno, exc.colno) from None
    except RecursionError:
        raise JSONInputError((), f"nested deeper than {max_depth} levels") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise JSONInputError((), "a number has too many digits") from None
    # Counting brackets bounds the depth from above; most bodies skip the walk.
    if data.count("[") + data.count("{") > max_depth or _SURROGATE_ESCAPE.search(data):
        _check(value, max_depth)
    return value


def _check(value: Any, max_depth: int) -> None:
    """Walk `value` (iteratively: it may be deep) for the first surrogate or excess depth."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise JSONInputError(path, "contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if len(path) >= max_depth:
            raise JSONInputError((), f"nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for key in node:
                if _SURROGATE.search(key):
                    raise JSONInputError(path, "an object key contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text")
            stack.extend((node[key], (*path, key)) for key in reversed(node))  # reversed: popped in document order
        else:
            stack.extend((node[i], (*path, i)) for i in range(len(node) - 1, -1, -1))


def format_path(path: tuple[str | int, ...], root: str = "body") -> str:
    """`("messages", 0, "content")` -> `messages[0].content`; `()` -> `root`. Long keys are clipped."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if len(part) <= 64 else part[:64] + "…"
            out += f".{key}" if out else key
    return out or root
