"""Token ids as text and bytes, for OpenAI logprobs.

A byte-level BPE token (GPT-2 / Qwen style) can be part of a UTF-8 character, so its decoded
text alone may be "\ufffd"; its exact bytes come from the byte-to-unicode alphabet of its
vocabulary string. Tokens of other tokenizers fall back to the UTF-8 of their decoded text.
"""

from __future__ import annotations

import functools


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """`text(id)` and `bytes(id)` of single tokens of `tokenizer`, memoised."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _unicode_to_byte()
        if isinstance(piece, str) and piece and all(c in table for c in piece):
            return [table[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))
