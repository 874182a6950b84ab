"""Canonical segment entries: each segment computed alone from an empty state (after the fixed
entry prefix), whole and batched, one at a time (the reference), or piece by piece (chunked
prefill of a long cold segment). Used through `ModelRunner.compute_entries` and friends.
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


class EntryComputer:
    """Computes a runner's canonical entries (its model, adapter and entry prefix)."""

    def __init__(self, runner: Any):  # the ModelRunner (not imported: it imports this module)
        self.r = runner

    def compute(self, segments: Sequence[tuple[int, ...]], seam: int, max_batch_tokens: int) -> list[SegmentEntry]:
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
        group: list[int] = []
        for i in order:
            width = len(segments[group[0]]) if group else len(segments[i])
            if group and (width * (len(group) + 1) > max_batch_tokens or 2 * len(segments[i]) < width):
                self._compute_group([segments[j] for j in group], seam, out, group)
                group = []
            group.append(i)
        if group:
            self._compute_group([segments[j] for j in group], seam, out, group)
        return out  # type: ignore[return-value]

    def _compute_group(self, segs, seam: int, out: list, slots: list[int]) -> None:
        prefix = self.r.entry_prefix
        P = len(prefix)
        longest = max(len(s) for s in segs)
        width = P + longest
        ids = torch.full((len(segs), width), self.r.pad_token_id, dtype=torch.long, device=self.r.device)
        for row, s in enumerate(segs):
            ids[row, : P + len(s)] = torch.tensor(prefix + tuple(s), dtype=torch.long)
        pos = torch.arange(width, device=self.r.device)[None].expand(len(segs), -1)
        cache = self.r.new_cache()
        adapter = self.r.adapter
        fused = bool(adapter.linear_layers) and adapter.supports_fused_body and longest > seam
        if fused:  # one forward; the body operators are computed inside its linear layers' kernel calls
            with adapter.capture_body(P + seam, [max(0, len(s) - seam) for s in segs], width) as cap:
                self.r.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        else:  # reference: one plain forward, operators computed afterwards from its recorded inputs
            with adapter.capture(0, width) as cap:
                self.r.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        for row, (s, slot) in enumerate(zip(segs, slots)):
            out[slot] = self._entry(cache, cap, row, s, seam, fused)

    def _entry(self, cache, cap, row: int, segment: tuple[int, ...], seam: int, fused: bool) -> SegmentEntry:
        """Row `row`'s entry from a forward over `entry_prefix` + `segment` (positions 0..P+L-1)."""
        adapter = self.r.adapter
        P, L = len(self.r.entry_prefix), len(segment)
        w = min(seam, L)
        keys, values = self._body_kv(cache, row, P + w, P + L)
        ops, tails = (), ()
        if adapter.linear_layers and w < L:
            ops = tuple(adapter.fused_operators(cap, row) if fused else adapter.span_operators(cap, row, P + w, P + L))
            tails = tuple(self._own_tail(adapter.conv_tail(cap, p, row, P + L), L) for p in range(len(adapter.linear_layers)))
        return SegmentEntry(tuple(segment), w, keys, values, ops, tails)

    def _body_kv(self, cache, row: int, start: int, end: int):
        """K/V columns [start, end) of row `row`, keys rotated back by the entry prefix's length (to local positions)."""
        keys, values = self.r.attention.slice(cache, row, start, end)
        P = len(self.r.entry_prefix)
        if P:
            keys = tuple(self.r.adapter.rotate_keys(k, -P) for k in keys)
        return keys, values

    def _own_tail(self, tail: torch.Tensor, length: int) -> torch.Tensor:
        """A conv tail cut to the segment's own inputs (a segment shorter than the kernel: not the prefix's)."""
        return tail if tail.shape[-1] <= length else tail[..., -length:].clone()

    def reference(self, segments: Sequence[tuple[int, ...]], seam: int,
                                  keep_graph: bool = False) -> list[SegmentEntry]:
        """The plain path, one segment at a time with no fused operators: what tests compare against.

        `keep_graph` (called with autograd on, outside inference mode): the entries keep the graph
        back to the weights, so a loss on a stitch of them trains what the segments write into the
        cache (training/hybrid/distill.py `HypicView`)."""
        out: list[SegmentEntry | None] = [None] * len(segments)
        for i, seg in enumerate(segments):
            ids = torch.tensor([self.r.entry_prefix + tuple(seg)], dtype=torch.long, device=self.r.device)
            pos = torch.arange(ids.shape[1], device=self.r.device)[None]
            cache = self.r.new_cache()
            with self.r.adapter.capture(0, ids.shape[1], keep_graph) as cap:
                self.r.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            out[i] = self._entry(cache, cap, 0, seg, seam, fused=False)
        return out  # type: ignore[return-value]

    def start(self, segment: tuple[int, ...], seam: int) -> PartialEntry:
        """Begin computing `segment`'s canonical entry piece by piece (see `advance_entry`); with an
        entry prefix, the prefix runs first on the entry's own cache."""
        cache = self.r.new_cache()
        if self.r.entry_prefix:
            self.r.forward(self.r.entry_prefix, 0, cache)
        return PartialEntry(tuple(segment), min(seam, len(segment)), cache)

    def advance(self, part: PartialEntry, max_tokens: int) -> SegmentEntry | None:
        """Run the next (up to) `max_tokens` tokens of `part`; return the entry once the segment is done.
        A piece never leaves a single token behind (it runs that one too): a one-token forward takes
        the model's one-token path, which records no inputs for the segment's conv tails.

        Equals `reference` of the whole segment up to float rounding: the
        pieces run on one cache, and their body operators compose exactly.
        """
        seg, w, P = part.segment, part.seam, len(self.r.entry_prefix)
        start, end = part.done, min(len(seg), part.done + max(1, max_tokens))
        if len(seg) - end == 1:
            end = len(seg)
        n = end - start
        head = min(max(w - start, 0), n)  # the piece's tokens still in the seam head
        ids = torch.tensor([seg[start:end]], dtype=torch.long, device=self.r.device)
        pos = torch.arange(P + start, P + end, device=self.r.device)[None]
        # As in `_compute_group`: the piece's body operators inside its own kernel calls where
        # the family can (no second pass per layer), else from the recorded inputs afterwards.
        fused = bool(len(self.r.linear)) and self.r.adapter.supports_fused_body and n > head
        capture = (self.r.adapter.capture_body(head, [n - head], n, P + start) if fused else self.r.adapter.capture(P + start, n))
        with capture as cap:
            self.r.model.base_model(input_ids=ids, position_ids=pos, cache=part.cache, use_cache=True)
        part.done = end
        if len(self.r.linear) and end > w:
            ops = self.r.adapter.fused_operators(cap, 0) if fused else self.r.adapter.span_operators(cap, 0, head, n)
            part.operators = ops if part.operators is None else [a.then(b) for a, b in zip(part.operators, ops)]
        if end < len(seg):
            return None
        keys, values = self._body_kv(part.cache, 0, P + w, P + len(seg))
        ops, tails = (), ()
        if len(self.r.linear) and w < len(seg):
            ops = tuple(part.operators)
            tails = tuple(self._own_tail(self.r.adapter.conv_tail(cap, p, 0, P + len(seg)), len(seg))
                          for p in range(len(self.r.linear)))
        return SegmentEntry(seg, w, keys, values, ops, tails)
