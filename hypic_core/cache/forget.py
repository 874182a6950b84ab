"""Every cached entry of some segments under some salts, whatever their seam width: what a store forgets
when the text those segments hold is deleted (a document removed from a tenant's collection).

A segment's key (hypic_core/algebra/keys.py) names the width of its seam head, so one segment under one
salt may have one entry per width that requests asked for (the configured seam, the accuracy guard's
wider ones, a client's `seam`), and the widths are not bounded. A `SegmentPattern` matches all of them
without enumerating widths: a memory tier's key string is

    hypic/v<schema>/<model>/w<width><salt part><prefix part>/<token digest>      (`SegmentKey.to_str`)

and a stored tier's is that followed by `/<storage dtype>` (`TieredSegmentStore.disk_key`). The pattern
keeps the part before the width (`head`: one model, one schema) and the set of parts after it (`tails`:
one per segment and salt), so matching a key is one prefix test and one set lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..algebra.keys import SegmentKey


@dataclass(frozen=True)
class SegmentPattern:
    """The keys of some segments' entries under some salts (and one entry prefix), at every seam width."""

    head: str  # "hypic/v<schema>/<model>/w": shared by every key of the model
    tails: frozenset[str]  # "<salt part><prefix part>/<token digest>", one per (segment, salt)

    @classmethod
    def of(cls, keys: Iterable[SegmentKey]) -> "SegmentPattern":
        """The pattern of `keys` (their seam widths are ignored). Raises ValueError for keys of several models
        or schemas, or none."""
        heads, tails = set(), set()
        for key in keys:
            text, head = key.to_str(), f"hypic/v{key.schema}/{key.model[:24]}/w"
            width = f"{key.seam}"
            if not text.startswith(head + width):  # the layout `SegmentKey.to_str` writes
                raise ValueError(f"unexpected key layout: {text}")
            heads.add(head)
            tails.add(text[len(head) + len(width):])
        if len(heads) != 1:
            raise ValueError(f"a pattern covers the keys of one model and schema, got {len(heads)}")
        return cls(heads.pop(), frozenset(tails))

    def matches(self, key: str) -> bool:
        """Whether `key` (a memory tier's key string) is one of the pattern's segments at some seam width."""
        if not key.startswith(self.head):
            return False
        rest = key[len(self.head):]
        digits = len(rest) - len(rest.lstrip("0123456789"))
        return digits > 0 and rest[digits:] in self.tails

    def matches_stored(self, key: str) -> bool:
        """Whether `key` (a stored tier's key: a memory key and `/<storage dtype>`) is one of the pattern's."""
        base, slash, _ = key.rpartition("/")
        return bool(slash) and self.matches(base)
