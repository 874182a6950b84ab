"""Token-aware chunking: cut a document into chunks of about `target_tokens` tokens.

Lengths are measured with a Hugging Face tokenizer (the serving model's, so a chunk's
`token_count` is what the engine will prefill), special-token strings in the text split into
ordinary tokens as the gateway's prompts split them. The text is split into units at sentence ends and
line breaks; units longer than `max_tokens` are cut into token windows. Units are then packed
greedily up to `target_tokens` (up to `max_tokens` while a chunk is still under `min_tokens`).
When a chunk must close, it closes at the last paragraph end that leaves it at least
`min_tokens` long, and the sentences after it open the next chunk; so chunks follow paragraphs
where they can, sentences otherwise. Each chunk's text is an exact span of the document.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

from retrieval.document import Chunk, Document

__all__ = ["Chunk", "Chunker", "default_chunk_tokens"]

DEFAULT_TARGET_TOKENS = 384


def default_chunk_tokens(context_window: int | None) -> int:
    """The chunk size for a model with `context_window` positions: 384 tokens, or a quarter of
    the context when that is less (so a prompt holds a few chunks and the question); 384 when
    the context is unknown."""
    if context_window is None or context_window <= 0:
        return DEFAULT_TARGET_TOKENS
    return max(1, min(DEFAULT_TARGET_TOKENS, context_window // 4))

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_BREAK = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+|\n\s*")


@dataclass(frozen=True)
class _Unit:
    """A sentence (or a token window of a long one): the span [start, end) of the text."""

    start: int
    end: int
    tokens: int
    ends_paragraph: bool


class Chunker:
    """Cut documents into chunks measured in `tokenizer` tokens.

    `tokenizer` is any fast Hugging Face tokenizer (it must return offset mappings).
    Every chunk has at most `max_tokens` tokens (special tokens excluded); chunks aim at
    `target_tokens` and, except a document's last, have at least `min_tokens` (default
    `target_tokens // 2`) unless a paragraph or the text forces a cut earlier.
    Chunking is deterministic: the same text and settings give the same chunks and ids.
    Raises `ValueError` for inconsistent sizes or a tokenizer without offset mappings.
    """

    def __init__(self, tokenizer: Any, target_tokens: int = 384, max_tokens: int = 512, min_tokens: int | None = None) -> None:
        min_tokens = target_tokens // 2 if min_tokens is None else min_tokens
        if not 0 < min_tokens <= target_tokens <= max_tokens:
            raise ValueError(f"need 0 < min_tokens <= target_tokens <= max_tokens, got {min_tokens}, {target_tokens}, {max_tokens}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("Chunker needs a fast (Rust-backed) Hugging Face tokenizer for offset mappings")
        self.tokenizer = tokenizer
        self.target_tokens = target_tokens
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Return the number of tokens of each text, without special tokens. Text that spells a
        special token (`<|im_start|>`) counts as the ordinary tokens it is made of, as the
        gateway tokenizes documents (app/service/prompter.py), not as the one special token."""
        encoded = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def chunk(self, document: Document) -> list[Chunk]:
        """Return the chunks of `document` in order; never empty, since a `Document` has text."""
        text = document.text.replace("\r\n", "\n").replace("\r", "\n")
        fitted = self._fit(text, self._pack(self._units(text)))
        return [Chunk.create(document, index, text[group[0].start : group[-1].end], count) for index, (group, count) in enumerate(fitted)]

    def _token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the tokens of `text` (zero-width tokens dropped)."""
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True,
                                 verbose=False)
        return [(start, end) for start, end in encoded["offset_mapping"] if end > start]

    def _units(self, text: str) -> list[_Unit]:
        """Split `text` into sentence units, token windows for units over `max_tokens`."""
        token_ends = [end for _, end in self._token_spans(text)]
        units: list[_Unit] = []
        for para_start, para_end in _pieces(text, 0, len(text), _PARAGRAPH_BREAK):
            sentences = _pieces(text, para_start, para_end, _SENTENCE_BREAK)
            for position, (start, end) in enumerate(sentences):
                tokens = bisect.bisect_right(token_ends, end) - bisect.bisect_right(token_ends, start)
                unit = _Unit(start, end, tokens, position == len(sentences) - 1)
                units.extend(self._windows(text, unit, self.target_tokens) if tokens > self.max_tokens else [unit])
        return units

    def _windows(self, text: str, unit: _Unit, size: int) -> list[_Unit]:
        """Cut `unit` into consecutive windows of at most `size` tokens, at character boundaries.

        A byte-level tokenizer splits a multi-byte character over tokens that all carry its
        offsets, so a window never ends inside one (it ends earlier, or later when one character
        alone has more than `size` tokens). Only whitespace lies between two windows: a character
        no token covers (WordPiece drops control characters) opens the next window.
        """
        spans = [(unit.start + s, unit.start + e) for s, e in self._token_spans(text[unit.start : unit.end])
                 if text[unit.start + s : unit.start + e].strip()]  # a space token alone is no window
        if not spans:
            return [unit]

        def ends_cleanly(i: int) -> bool:
            return i == len(spans) - 1 or spans[i + 1][0] >= spans[i][1]

        windows = []
        first, start = 0, unit.start
        while first < len(spans):
            last = min(first + size, len(spans)) - 1
            back = last
            while back > first and not ends_cleanly(back):
                back -= 1
            last = back if ends_cleanly(back) else next(i for i in range(last, len(spans)) if ends_cleanly(i))
            end = unit.end if last == len(spans) - 1 else spans[last][1]
            windows.append(_Unit(start, end, last - first + 1, unit.ends_paragraph and end == unit.end))
            first, start = last + 1, _strip(text, end, unit.end)[0]
        return windows

    def _fits(self, size: int, unit: _Unit) -> bool:
        """Whether `unit` may join a chunk that already holds `size` tokens."""
        limit = self.max_tokens if size < self.min_tokens else self.target_tokens
        return size + unit.tokens <= limit

    def _pack(self, units: list[_Unit]) -> list[list[_Unit]]:
        """Group units greedily into chunks, closing at paragraph ends where possible."""
        groups: list[list[_Unit]] = []
        current: list[_Unit] = []
        for unit in units:
            while current and not self._fits(sum(u.tokens for u in current), unit):
                cut = self._cut_point(current)
                groups.append(current[:cut])
                current = current[cut:]
            current.append(unit)
        if groups and sum(u.tokens for u in current) < self.min_tokens and sum(u.tokens for u in groups[-1] + current) <= self.target_tokens:
            groups[-1].extend(current)
        else:
            groups.append(current)
        return groups

    def _cut_point(self, units: list[_Unit]) -> int:
        """Length of the prefix of `units` to close as a chunk: through the last paragraph end
        that keeps the chunk at `min_tokens` or more, else all of `units`."""
        size = 0
        cut = len(units)
        for position, unit in enumerate(units):
            size += unit.tokens
            if unit.ends_paragraph and size >= self.min_tokens:
                cut = position + 1
        return cut

    def _fit(self, text: str, groups: list[list[_Unit]]) -> list[tuple[list[_Unit], int]]:
        """Split any group whose exact token count exceeds `max_tokens` (unit counts are
        estimates: a tokenizer may merge across unit boundaries). Returns each final group with
        its exact count, so no chunk text is tokenized twice."""
        counts = self.count_tokens([text[group[0].start : group[-1].end] for group in groups])
        fitted: list[tuple[list[_Unit], int]] = []
        for group, count in zip(groups, counts):
            if count <= self.max_tokens:
                fitted.append((group, count))
            elif len(group) > 1:
                fitted.extend(self._fit(text, [group[: len(group) // 2], group[len(group) // 2 :]]))
            else:
                halves = self._windows(text, group[0], max(1, (count + 1) // 2))
                # One window means a single token that is over the limit alone: keep it.
                fitted.extend([(group, count)] if len(halves) == 1 else self._fit(text, [[window] for window in halves]))
        return fitted


def _pieces(text: str, start: int, end: int, separator: re.Pattern[str]) -> list[tuple[int, int]]:
    """Spans of the non-blank pieces of text[start:end] between `separator` matches,
    stripped of surrounding whitespace."""
    pieces = []
    position = start
    for match in separator.finditer(text, start, end):
        pieces.append((position, match.start() + len(match.group().rstrip())))
        position = match.end()
    pieces.append((position, end))
    return [span for span in (_strip(text, s, e) for s, e in pieces) if span[1] > span[0]]


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    """The span [start, end) narrowed to exclude leading and trailing whitespace."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
