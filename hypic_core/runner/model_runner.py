"""Runs the model: plain forwards on a cache, canonical segment entries (whole or piece by piece),
seam stitching, exact snapshots, and the batched decode forward.

The runner touches tensors and the transformers cache; it knows nothing of stores, requests
or queues. Every method expects to be called under `torch.inference_mode()` by the engine (training's
differentiable stitch calls `compute_entries_reference(keep_graph=True)` and `stitch` with autograd on).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from ..adapters import ModelAdapter
from ..adapters.base import StitchSpan
from ..algebra.entry import SegmentEntry
from ..algebra.operators import LinearOperator
from ..cache.exact_runs import ExactSnapshot
from .batch import DecodeBatch
from .layers import AttentionLayers, LinearLayers, LinearRows, scaled


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


class ModelRunner:
    """Owns one model and its adapter."""

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, pad_token_id: int = 0,
                 entry_prefix: Sequence[int] = ()):
        self.model = model
        self.adapter = adapter
        self.pad_token_id = pad_token_id
        # Canonical entries are computed after these tokens (EngineConfig.entry_prefix); their own
        # K/V and state are dropped, the segment's keys rotated back to local positions.
        self.entry_prefix = tuple(int(t) for t in entry_prefix)
        self.device = model.device
        self.attention = AttentionLayers(adapter)
        self.linear = LinearLayers(adapter)
        self.batch = DecodeBatch(model, adapter, self.attention, self.linear)

    def new_cache(self) -> DynamicCache:
        return self.adapter.new_cache()

    decode_step = "module"  # what the batched decode forward runs: "lean" or "module" (use_decode_step)

    def use_decode_step(self, kind: str, kernel: str = "torch") -> str:
        """Run the batched decode on the lean step ("lean") or the HF modules ("module"); returns what runs
        (a family the lean step does not cover keeps "module": runner/decode_step.py `uncovered_reason`).
        `kernel`: the lean step's op table (config.DECODE_KERNELS; what runs is `batch.step.kernel`)."""
        from .decode_step import LeanDecodeStep

        if kind not in ("lean", "module"):
            raise ValueError(f"decode step must be lean or module, got {kind!r}")
        self.batch.step = LeanDecodeStep.build(self.model, self.adapter, kernel=kernel) if kind == "lean" else None
        self.decode_step = "module" if self.batch.step is None else "lean"
        return self.decode_step

    @property
    def decode_kernel(self) -> str | None:
        """The op table the lean step runs (config.DECODE_KERNELS; a native one may have fallen back to
        "torch"), None on the module path."""
        return None if self.batch.step is None else self.batch.step.kernel

    @contextlib.contextmanager
    def decoding(self, caches: Sequence, ranges: bool = False) -> Iterator[Callable[[Sequence[int], Sequence[int]], torch.Tensor]]:
        """The batched decode forward as a benchmark drives it (bench/harness.py), with no scheduler: rows
        0..n-1 join from `caches` (batch-1 prefill caches, taken over as the engine's own would be);
        yields `step(token_ids, positions) -> logits [n, vocab]` (fp32), each row advanced by one token;
        the rows leave at exit. `ranges`: the lean step marks each part with a torch.profiler range
        (attention, mamba2, gated_deltanet, mlp, lm_head, embed+rope). Only while nothing else decodes."""
        if len(self.batch):
            raise RuntimeError("decoding() needs an idle decode batch; the engine has running sequences")
        step = self.batch.step
        self.batch.sync(list(range(len(caches))), dict(enumerate(caches)))
        if step is not None:
            step.ranges = ranges
        try:
            yield self.batch.forward
        finally:
            if step is not None:
                step.ranges = False
            self.batch.sync([], {})

    def forward(self, token_ids: Sequence[int], start: int, cache: DynamicCache, logits: bool = False):
        """Run `token_ids` at positions start.. on top of `cache` (mutated).

        Returns the last position's logits (fp32, [vocab]) when `logits`, else None.
        """
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        if logits:
            out = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
            return out.logits[0, -1].float()
        self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        return None

    # --- canonical entries ----------------------------------------------------------------
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
        prefix = self.entry_prefix
        P = len(prefix)
        longest = max(len(s) for s in segs)
        width = P + longest
        ids = torch.full((len(segs), width), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, s in enumerate(segs):
            ids[row, : P + len(s)] = torch.tensor(prefix + tuple(s), dtype=torch.long)
        pos = torch.arange(width, device=self.device)[None].expand(len(segs), -1)
        cache = self.new_cache()
        adapter = self.adapter
        fused = bool(adapter.linear_layers) and adapter.supports_fused_body and longest > seam
        if fused:  # one forward; the body operators are computed inside its linear layers' kernel calls
            with adapter.capture_body(P + seam, [max(0, len(s) - seam) for s in segs], width) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        else:  # reference: one plain forward, operators computed afterwards from its recorded inputs
            with adapter.capture(0, width) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        for row, (s, slot) in enumerate(zip(segs, slots)):
            out[slot] = self._entry(cache, cap, row, s, seam, fused)

    def _entry(self, cache, cap, row: int, segment: tuple[int, ...], seam: int, fused: bool) -> SegmentEntry:
        """Row `row`'s entry from a forward over `entry_prefix` + `segment` (positions 0..P+L-1)."""
        adapter = self.adapter
        P, L = len(self.entry_prefix), len(segment)
        w = min(seam, L)
        keys, values = self._body_kv(cache, row, P + w, P + L)
        ops, tails = (), ()
        if adapter.linear_layers and w < L:
            ops = tuple(adapter.fused_operators(cap, row) if fused else adapter.span_operators(cap, row, P + w, P + L))
            tails = tuple(self._own_tail(adapter.conv_tail(cap, p, row, P + L), L) for p in range(len(adapter.linear_layers)))
        return SegmentEntry(tuple(segment), w, keys, values, ops, tails)

    def _body_kv(self, cache, row: int, start: int, end: int):
        """K/V columns [start, end) of row `row`, keys rotated back by the entry prefix's length (to local positions)."""
        keys, values = self.attention.slice(cache, row, start, end)
        P = len(self.entry_prefix)
        if P:
            keys = tuple(self.adapter.rotate_keys(k, -P) for k in keys)
        return keys, values

    def _own_tail(self, tail: torch.Tensor, length: int) -> torch.Tensor:
        """A conv tail cut to the segment's own inputs (a segment shorter than the kernel: not the prefix's)."""
        return tail if tail.shape[-1] <= length else tail[..., -length:].clone()

    def compute_entries_reference(self, segments: Sequence[tuple[int, ...]], seam: int,
                                  keep_graph: bool = False) -> list[SegmentEntry]:
        """The plain path, one segment at a time with no fused operators: what tests compare against.

        `keep_graph` (called with autograd on, outside inference mode): the entries keep the graph
        back to the weights, so a loss on a stitch of them trains what the segments write into the
        cache (training/hybrid/distill.py `HypicView`)."""
        out: list[SegmentEntry | None] = [None] * len(segments)
        for i, seg in enumerate(segments):
            ids = torch.tensor([self.entry_prefix + tuple(seg)], dtype=torch.long, device=self.device)
            pos = torch.arange(ids.shape[1], device=self.device)[None]
            cache = self.new_cache()
            with self.adapter.capture(0, ids.shape[1], keep_graph) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            out[i] = self._entry(cache, cap, 0, seg, seam, fused=False)
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
        keys, values = self._body_kv(part.cache, 0, P + w, P + len(seg))
        ops, tails = (), ()
        if len(self.linear) and w < len(seg):
            ops = tuple(part.operators)
            tails = tuple(self._own_tail(self.adapter.conv_tail(cap, p, 0, P + len(seg)), len(seg))
                          for p in range(len(self.linear)))
        return SegmentEntry(seg, w, keys, values, ops, tails)

    def footprint(self) -> tuple[int, int, int]:
        """(attention K/V bytes per token, linear conv + state bytes per sequence, linear state elements
        per sequence), measured on one token."""
        with torch.inference_mode():
            cache = self.new_cache()
            self.forward([0], 0, cache)
            keys, values = self.attention.kv(cache)
            kv = sum(t.numel() * t.element_size() for t in (*keys, *values))
            rows = self.linear.rows(cache)
            state = sum(t.numel() * t.element_size() for pair in rows for t in pair)
            elements = sum(pair[1].numel() for pair in rows)
        return kv, state, elements

    # --- stitching --------------------------------------------------------------------------
    def stitch(self, cache, context: Sequence[tuple[int, ...]], entries: Sequence[SegmentEntry],
               question: tuple[int, ...], transition: bool = True, start: int = 0, key_scale: float = 1.0,
               keep: int | None = None) -> torch.Tensor:
        """Stitched prefill of `context` (with their entries) then `question` on `cache`, which is
        empty (`start` 0) or holds an exactly computed prefix of `start` tokens. The bodies' keys are
        multiplied by `key_scale` (`EngineConfig.reuse_key_scale`); seam heads and the question are not.

        Returns the first-token logits; with `keep`, the last `keep` positions' logits ([keep, vocab]:
        training runs a question and its reply as one stitched `question`, training/reuse/modes.py).
        Uses the fused path (one forward for every seam head and the question) when the adapter
        supports it, else `stitch_sequential` (which has no `keep`: ValueError).
        """
        if not self.adapter.supports_fused_stitch:
            if keep is not None:
                raise ValueError(f"{type(self.adapter).__name__} has no fused stitch: stitch(keep=...) needs one")
            return self.stitch_sequential(cache, context, entries, question, transition, start, key_scale)
        adapter = self.adapter
        run_ids: list[int] = []
        run_pos: list[int] = []
        spans: list[StitchSpan] = []
        body_pos: list[torch.Tensor] = []
        bodies: list[SegmentEntry] = []
        moves: list[torch.Tensor] = []  # per body column: how far its key moves (the body's segment offset)
        offset = start
        for seg, entry in zip(context, entries):
            w = entry.seam
            has_body = entry.body_length > 0
            spans.append(StitchSpan(len(run_ids), len(run_ids) + w, entry if has_body else None))
            run_ids += seg[:w]
            run_pos += range(offset, offset + w)
            if has_body:
                body_pos.append(torch.arange(offset + w, offset + len(seg)))
                bodies.append(entry)
                moves.append(torch.full((entry.body_length,), offset, dtype=torch.long))
            offset += len(seg)
        spans.append(StitchSpan(len(run_ids), len(run_ids) + len(question)))
        run_ids += question
        run_pos += range(offset, offset + len(question))
        if bodies:  # every body's keys moved to its offset, per layer in one pass (the angles worked out once)
            move = adapter.key_mover(torch.cat(moves))
            self.attention.append(
                cache, [scaled(move(torch.cat([e.keys[j] for e in bodies], dim=1)), key_scale)[None] for j in range(len(self.attention))],
                [torch.cat([e.values[j] for e in bodies], dim=1)[None] for j in range(len(self.attention))])
        if start == 0:
            self.linear.zero_start(cache)  # else the prefix left its states in the cache
        qpos = torch.tensor(run_pos)
        kpos = torch.cat([torch.arange(start), *body_pos, qpos])
        mask = (kpos[None, :] <= qpos[:, None])[None, None].to(self.device)
        ids = torch.tensor([run_ids], dtype=torch.long, device=self.device)
        with adapter.stitch(spans, transition) as cap:
            out = self.model(input_ids=ids, position_ids=qpos[None].to(self.device), cache=cache, use_cache=True,
                             attention_mask=adapter.mask_argument(mask), logits_to_keep=keep or 1)
        adapter.finish_stitch(cache, cap)
        return out.logits[0, -1].float() if keep is None else out.logits[0].float()

    def body_columns(self, context: Sequence[tuple[int, ...]], entries: Sequence[SegmentEntry], start: int = 0) -> list[tuple[int, int]]:
        """The cache columns [a, b) that `stitch` fills with the entries' bodies (their keys are the
        scaled ones): after the exact prefix of `start` tokens, all the bodies in one run on the fused
        path; on the sequential path each body after its own seam head."""
        lengths = [len(seg) - entry.seam for seg, entry in zip(context, entries) if entry.body_length > 0]
        if self.adapter.supports_fused_stitch:
            return [(start, start + sum(lengths))] if lengths else []
        spans, offset = [], start
        for seg, entry in zip(context, entries):
            if entry.body_length > 0:
                spans.append((offset + entry.seam, offset + len(seg)))
            offset += len(seg)
        return spans

    def stitch_sequential(self, cache, context, entries, question, transition: bool = True, start: int = 0,
                          key_scale: float = 1.0) -> torch.Tensor:
        """Reference stitch: each seam head through all layers, then its body appended; then the question."""
        offset = start
        for seg, entry in zip(context, entries):
            if entry.seam:
                self.forward(seg[: entry.seam], offset, cache)
            self.append_body(cache, entry, offset, transition, key_scale)
            offset += len(seg)
        return self.forward(question, offset, cache, logits=True)

    def append_body(self, cache: DynamicCache, entry: SegmentEntry, offset: int, transition: bool = True,
                    key_scale: float = 1.0) -> None:
        """Append `entry`'s body after its (already run) seam head, the segment starting at `offset`.

        Attention layers get the body K/V rotated from local positions to offset + seam..;
        linear layers advance S <- T S + E (hypic), or S <- S + E (pic-naive: the transition
        is ignored), and shift the segment's conv tail into the conv state.
        """
        if entry.body_length == 0:
            return
        self.attention.append_body(cache, entry, offset, key_scale)  # creates the layers in lazily built caches
        self.linear.append_body(cache, entry, transition)

    # --- exact prefixes (`prefix` mode) -------------------------------------------------------
    def linear_snapshot(self, cache) -> LinearRows:
        """Every linear layer's (conv, state), copied: taken at each segment boundary."""
        return self.linear.snapshot(cache)

    def exact_snapshot(self, cache, boundaries: Sequence[int], linear: Sequence[LinearRows]) -> ExactSnapshot:
        """A snapshot of `cache`'s K/V (row 0, copied) with the linear states taken at `boundaries`."""
        keys, values = self.attention.kv(cache)
        return ExactSnapshot(tuple(k[0].clone() for k in keys), tuple(v[0].clone() for v in values),
                              tuple(boundaries), tuple(linear))

    def restore_exact(self, cache, snap: ExactSnapshot, n: int) -> int:
        """Load the first `n` segments of `snap` into an empty `cache`; return the next position."""
        upto = snap.boundaries[n - 1]
        self.attention.append(cache, [k[None, :, :upto].clone() for k in snap.keys],
                              [v[None, :, :upto].clone() for v in snap.values])
        self.linear.restore(cache, snap.linear[n - 1])
        return upto
