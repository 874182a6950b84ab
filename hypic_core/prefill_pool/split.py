"""Split a long cold segment into pieces computed independently, and join their entries.

Each piece is computed canonically on its own (empty state, local positions); the first keeps the
segment's seam head, the others have none. Joining them into one entry for the whole segment:

- attention: the pieces' body K/V concatenated, each piece's keys rotated from its local
  positions to its offset in the segment;
- linear layers: the body operators composed, (T1, E1) then (T2, E2) = (T2 T1, T2 E1 + E2);
- conv tail: the last piece's (a piece is longer than any conv kernel).

This is exact for each linear layer *given its inputs*, but the inputs differ: attention inside
a piece does not see the pieces before it, and each piece's conv and linear layers start from
empty, so a joined entry is an approximation of the segment's canonical entry (its accuracy
cost: docs/benchmarks.md, "Splitting long cold segments"). Exactly what a joined entry equals is
stitching the pieces as consecutive segments (`join_pieces` is that stitch, precomputed).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..algebra.entry import SegmentEntry

MIN_PIECE = 64  # smallest piece size allowed: pieces (>= MIN_PIECE / 2 tokens) outlast any conv kernel,
#                 and short pieces lose the most context


def split_points(length: int, piece_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of near-equal pieces of at most `piece_tokens` tokens covering `length` tokens."""
    if piece_tokens < MIN_PIECE:
        raise ValueError(f"pieces must be >= {MIN_PIECE} tokens, got {piece_tokens}")
    n = max(1, -(-length // piece_tokens))
    bounds = [round(i * length / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def join_pieces(pieces: Sequence[SegmentEntry], adapter) -> SegmentEntry:
    """One entry for the concatenated pieces' segment: the first piece carries the seam head, the
    others were computed with seam 0. Does not mutate the pieces."""
    head = pieces[0]
    if any(p.seam for p in pieces[1:]):
        raise ValueError("only the first piece may have a seam head")
    if head.body_length == 0 and len(pieces) > 1:
        raise ValueError("the first piece must be longer than the seam")
    keys = [[k] for k in head.keys]
    values = [[v] for v in head.values]
    ops = list(head.operators)
    offset = head.length
    for p in pieces[1:]:
        for j in range(len(keys)):
            keys[j].append(adapter.rotate_keys(p.keys[j], offset))
            values[j].append(p.values[j])
        ops = [a.then(b) for a, b in zip(ops, p.operators)]
        offset += p.length
    return SegmentEntry(tuple(t for p in pieces for t in p.token_ids), head.seam,
                        tuple(torch.cat(ks, dim=-2) for ks in keys), tuple(torch.cat(vs, dim=-2) for vs in values),
                        tuple(ops), pieces[-1].conv_tails)
