"""Canonical segment entries: each segment computed alone from an empty state (after the fixed
entry prefix), whole and batched, one at a time (the reference), or piece by piece (chunked
prefill of a long cold segment). `ModelRunner` inherits these methods (`compute_entries` and friends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..algebra.entry import SegmentEntry
from ..algebra.operators import LinearOperator

@dataclass
class PartialEntry:
    """A canonical entry being computed piece by piece (chunked prefill of a long cold segment).

    Each piece continues the segment's own cache, so every layer sees exactly the inputs of a
    one-piece computation; the body operators of the pieces compose exactly (docs/architecture.md).
    """

    segment: tuple[int, ...]
    seam: int
    cache: Any
    done: int = 0  # tokens computed so far
    operators: list[LinearOperator] | None = None  # body operators composed so far, one per linear layer

    @property
    def left(self) -> int:
        return len(self.segment) - self.done


class CanonicalEntries:
    """`ModelRunner`'s canonical-entry methods, kept in this file (the runner inherits them): they read its
    `model`, `adapter`, `attention`, `linear`, `entry_prefix`, `pad_token_id`, `device` and `new_cache`."""

    def compute_entries(self, segments: Sequence[tuple[int, ...]], seam: int, max_batch_tokens: int) -> list[SegmentEntry]:
        """Canonical entries of `segments`, each computed alone from an empty state at positions 0..L-1
        (after `entry_prefix`, when set: the segment at positions P..P+L-1 behind it, its keys then
        rotated back to 0..L-1, its body operators T and E from the recorded inputs, E from a zero state).

        Segments are batched (right-padded: causal layers never see the padding of earlier
        tokens) in groups of at most `max_batch_tokens` padded tokens, longest first; a
        segment shorter than half its group's width starts a new group, so padding stays
        under half of any row.
        """
        order = sorted(range(len(segments)), key=lambda i: -len(segments[i]))
        out: list[SegmentEntry | None] = [None] * len(segments)
        groups: list[list[int]] = []
        for i in order:
            width = len(segments[groups[-1][0]]) if groups else 0
            if not groups or width * (len(groups[-1]) + 1) > max_batch_tokens or 2 * len(segments[i]) < width:
                groups.append([])
            groups[-1].append(i)
        for group in groups:
            self._compute_group(segments, group, seam, out)
        return out  # type: ignore[return-value]

    def _compute_group(self, segments, group: list[int], seam: int, out: list, fusable: bool = True,
                       keep_graph: bool = False) -> None:
        """One forward over `entry_prefix` + each segment of `group` (right-padded), their entries into
        `out`: the body operators inside the linear layers' kernel calls where the family can and
        `fusable`, else from the recorded inputs afterwards (the reference)."""
        segs, prefix = [segments[i] for i in group], self.entry_prefix
        P, longest = len(prefix), max(len(segments[i]) for i in group)
        width = P + longest
        ids = torch.full((len(segs), width), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, s in enumerate(segs):
            ids[row, : P + len(s)] = torch.tensor(prefix + tuple(s), dtype=torch.long)
        pos = torch.arange(width, device=self.device)[None].expand(len(segs), -1)
        cache = self.new_cache()
        adapter = self.adapter
        fused = fusable and bool(adapter.linear_layers) and adapter.supports_fused_body and longest > seam
        capture = (adapter.capture_body(P + seam, [max(0, len(s) - seam) for s in segs], width) if fused
                   else adapter.capture(0, width, keep_graph))
        with capture as cap:
            self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        for row, (s, slot) in enumerate(zip(segs, group)):
            out[slot] = self._entry(cache, cap, row, s, seam, fused)

    def _entry(self, cache, cap, row: int, segment: tuple[int, ...], seam: int, fused: bool = False,
               operators: list | None = None) -> SegmentEntry:
        """Row `row`'s entry from a forward over `entry_prefix` + `segment` (positions 0..P+L-1); its body
        operators `operators` when they were composed piece by piece, else from `cap`."""
        adapter = self.adapter
        P, L = len(self.entry_prefix), len(segment)
        w = min(seam, L)
        keys, values = self.attention.slice(cache, row, P + w, P + L)
        if P:  # keys rotated back by the entry prefix's length (to local positions)
            keys = tuple(adapter.rotate_keys(k, -P) for k in keys)
        ops, tails = (), ()
        if adapter.linear_layers and w < L:
            if operators is None:
                operators = adapter.fused_operators(cap, row) if fused else adapter.span_operators(cap, row, P + w, P + L)
            ops = tuple(operators)
            # each conv tail cut to the segment's own inputs (a segment shorter than the kernel: not the prefix's)
            tails = tuple(tail if tail.shape[-1] <= L else tail[..., -L:].clone()
                          for tail in (adapter.conv_tail(cap, p, row, P + L) for p in range(len(adapter.linear_layers))))
        return SegmentEntry(tuple(segment), w, keys, values, ops, tails)

    def compute_entries_reference(self, segments: Sequence[tuple[int, ...]], seam: int,
                                  keep_graph: bool = False) -> list[SegmentEntry]:
        """The plain path, one segment at a time with no fused operators: what tests compare against.

        `keep_graph` (called with autograd on, outside inference mode): the entries keep the graph
        back to the weights, so a loss on a stitch of them trains what the segments write into the
        cache (training/hybrid/distill.py `HypicView`)."""
        out: list[SegmentEntry | None] = [None] * len(segments)
        for i in range(len(segments)):
            self._compute_group(segments, [i], seam, out, fusable=False, keep_graph=keep_graph)
        return out  # type: ignore[return-value]

    def start_entry(self, segment: tuple[int, ...], seam: int) -> PartialEntry:
        """Begin computing `segment`'s canonical entry piece by piece (see `advance_entry`); with an
        entry prefix, the prefix runs first on the entry's own cache."""
        cache = self.new_cache()
        if self.entry_prefix:
            self.forward(self.entry_prefix, 0, cache)
        return PartialEntry(tuple(segment), min(seam, len(segment)), cache)

    def advance_entry(self, part: PartialEntry, max_tokens: int) -> SegmentEntry | None:
        """Run the next (up to) `max_tokens` tokens of `part`; return the entry once the segment is done.
        A piece never leaves a single token behind (it runs that one too): a one-token forward takes
        the model's one-token path, which records no inputs for the segment's conv tails.

        Equals `compute_entries_reference` of the whole segment up to float rounding: the
        pieces run on one cache, and their body operators compose exactly.
        """
        seg, w, P = part.segment, part.seam, len(self.entry_prefix)
        start, end = part.done, min(len(seg), part.done + max(1, max_tokens))
        if len(seg) - end == 1:
            end = len(seg)
        n = end - start
        head = min(max(w - start, 0), n)  # the piece's tokens still in the seam head
        ids = torch.tensor([seg[start:end]], dtype=torch.long, device=self.device)
        pos = torch.arange(P + start, P + end, device=self.device)[None]
        # As in `_compute_group`: the piece's body operators inside its own kernel calls where
        # the family can (no second pass per layer), else from the recorded inputs afterwards.
        fused = bool(len(self.linear)) and self.adapter.supports_fused_body and n > head
        capture = (self.adapter.capture_body(head, [n - head], n, P + start) if fused else self.adapter.capture(P + start, n))
        with capture as cap:
            self.model.base_model(input_ids=ids, position_ids=pos, cache=part.cache, use_cache=True)
        part.done = end
        if len(self.linear) and end > w:
            ops = self.adapter.fused_operators(cap, 0) if fused else self.adapter.span_operators(cap, 0, head, n)
            part.operators = ops if part.operators is None else [a.then(b) for a, b in zip(part.operators, ops)]
        if end < len(seg):
            return None
        return self._entry(part.cache, cap, 0, seg, w, operators=part.operators)
