"""Runs the model: plain forwards on a cache, canonical segment entries (runner/entries.py),
seam stitching, exact snapshots, and the batched decode forward.

The runner touches tensors and the transformers cache; it knows nothing of stores, requests
or queues. Every method expects to be called under `torch.inference_mode()` by the engine (training's
differentiable stitch calls `compute_entries_reference(keep_graph=True)` and `stitch` with autograd on).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from ..adapters import ModelAdapter
from ..adapters.base import StitchSpan
from ..algebra.entry import SegmentEntry
from ..cache.exact_runs import ExactSnapshot
from .batch import DecodeBatch
from .entries import CanonicalEntries, PartialEntry  # noqa: F401 - the engine imports PartialEntry from here
from .layers import AttentionLayers, LinearLayers, LinearRows, scaled


class ModelRunner(CanonicalEntries):
    """Owns one model and its adapter; its canonical-entry methods (`compute_entries`,
    `compute_entries_reference`, `start_entry`, `advance_entry`) are runner/entries.py's."""

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
