"""Runs the model: plain forwards on a cache, canonical segment entries, and seam stitching.

The runner touches tensors and the transformers cache; it knows nothing of stores, requests
or queues. Every method expects to be called under `torch.inference_mode()` by the engine.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from .adapters import ModelAdapter
from .adapters.base import StitchSpan
from .entry import SegmentEntry


class ModelRunner:
    """Owns one model and its adapter."""

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, pad_token_id: int = 0):
        self.model = model
        self.adapter = adapter
        self.pad_token_id = pad_token_id
        self.device = model.device

    def new_cache(self) -> DynamicCache:
        return self.adapter.new_cache()

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
        """Canonical entries of `segments`, each computed alone from an empty state at positions 0..L-1.

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
        width = max(len(s) for s in segs)
        ids = torch.full((len(segs), width), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, s in enumerate(segs):
            ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(width, device=self.device)[None].expand(len(segs), -1)
        cache = self.new_cache()
        adapter = self.adapter
        fused = bool(adapter.linear_layers) and adapter.supports_fused_body and width > seam
        if fused:  # one forward; the body operators are computed inside its linear layers' kernel calls
            with adapter.capture_body(seam, [max(0, len(s) - seam) for s in segs], width) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        else:  # reference: one plain forward, operators computed afterwards from its recorded inputs
            with adapter.capture(0, width) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        for row, (s, slot) in enumerate(zip(segs, slots)):
            out[slot] = self._entry(cache, cap, row, s, seam, fused)

    def _entry(self, cache, cap, row: int, segment: tuple[int, ...], seam: int, fused: bool) -> SegmentEntry:
        adapter = self.adapter
        L = len(segment)
        w = min(seam, L)
        keys = tuple(cache.layers[i].keys[row, :, w:L].clone() for i in adapter.attention_layers)
        values = tuple(cache.layers[i].values[row, :, w:L].clone() for i in adapter.attention_layers)
        ops, tails = (), ()
        if adapter.linear_layers and w < L:
            ops = tuple(adapter.fused_operators(cap, row) if fused else adapter.span_operators(cap, row, w, L))
            tails = tuple(adapter.conv_tail(cap, p, row, L) for p in range(len(adapter.linear_layers)))
        return SegmentEntry(tuple(segment), w, keys, values, ops, tails)

    def compute_entries_reference(self, segments: Sequence[tuple[int, ...]], seam: int) -> list[SegmentEntry]:
        """The plain path, one segment at a time with no fused operators: what tests compare against."""
        out: list[SegmentEntry | None] = [None] * len(segments)
        for i, seg in enumerate(segments):
            ids = torch.tensor([seg], dtype=torch.long, device=self.device)
            pos = torch.arange(len(seg), device=self.device)[None]
            cache = self.new_cache()
            with self.adapter.capture(0, len(seg)) as cap:
                self.model.base_model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            out[i] = self._entry(cache, cap, 0, seg, seam, fused=False)
        return out  # type: ignore[return-value]

    # --- stitching --------------------------------------------------------------------------
    def stitch(self, cache, context: Sequence[tuple[int, ...]], entries: Sequence[SegmentEntry],
               question: tuple[int, ...], compose: bool = True) -> torch.Tensor:
        """Stitched prefill of `context` (with their entries) then `question` on an empty `cache`.

        Returns the first-token logits. Uses the fused path (one forward for every seam head
        and the question) when the adapter supports it, else `stitch_sequential`.
        """
        if not self.adapter.supports_fused_stitch:
            return self.stitch_sequential(cache, context, entries, question, compose)
        adapter = self.adapter
        run_ids: list[int] = []
        run_pos: list[int] = []
        spans: list[StitchSpan] = []
        body_pos: list[torch.Tensor] = []
        body_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in adapter.attention_layers]
        offset = 0
        for seg, entry in zip(context, entries):
            w = entry.seam
            has_body = entry.body_length > 0
            spans.append(StitchSpan(len(run_ids), len(run_ids) + w, entry if has_body else None))
            run_ids += seg[:w]
            run_pos += range(offset, offset + w)
            if has_body:
                body_pos.append(torch.arange(offset + w, offset + len(seg)))
                for j in range(len(adapter.attention_layers)):
                    body_kv[j].append((adapter.rotate_keys(entry.keys[j], offset), entry.values[j]))
            offset += len(seg)
        spans.append(StitchSpan(len(run_ids), len(run_ids) + len(question)))
        run_ids += question
        run_pos += range(offset, offset + len(question))
        for j, layer in enumerate(adapter.attention_layers):
            if body_kv[j]:
                k = torch.cat([k for k, _ in body_kv[j]], dim=1)[None]
                v = torch.cat([v for _, v in body_kv[j]], dim=1)[None]
                cache.update(k, v, layer)
        for p in range(len(adapter.linear_layers)):
            adapter.read_linear_state(cache, p)  # start every linear layer from a zero state
        qpos = torch.tensor(run_pos)
        kpos = torch.cat([*body_pos, qpos])
        mask = (kpos[None, :] <= qpos[:, None])[None, None].to(self.device)
        ids = torch.tensor([run_ids], dtype=torch.long, device=self.device)
        with adapter.stitch(spans, compose) as cap:
            out = self.model(input_ids=ids, position_ids=qpos[None].to(self.device), cache=cache, use_cache=True,
                             attention_mask=adapter.mask_argument(mask), logits_to_keep=1)
        adapter.finish_stitch(cache, cap)
        return out.logits[0, -1].float()

    def stitch_sequential(self, cache, context, entries, question, compose: bool = True) -> torch.Tensor:
        """Reference stitch: each seam head through all layers, then its body appended; then the question."""
        offset = 0
        for seg, entry in zip(context, entries):
            if entry.seam:
                self.forward(seg[: entry.seam], offset, cache)
            self.append_body(cache, entry, offset, compose=compose)
            offset += len(seg)
        return self.forward(question, offset, cache, logits=True)

    def append_body(self, cache: DynamicCache, entry: SegmentEntry, offset: int, compose: bool = True) -> None:
        """Append `entry`'s body after its (already run) seam head, the segment starting at `offset`.

        Attention layers get the body K/V rotated from local positions to offset + seam..;
        linear layers advance S <- T S + E (`compose`), or S <- S + E (pic-naive: the
        transition is ignored), and shift the segment's conv tail into the conv state.
        """
        if entry.body_length == 0:
            return
        for j, layer in enumerate(self.adapter.attention_layers):
            k = self.adapter.rotate_keys(entry.keys[j], offset)[None]
            cache.update(k, entry.values[j][None], layer)  # creates the layer in lazily built caches
        for p in range(len(self.adapter.linear_layers)):
            conv, state = self.adapter.read_linear_state(cache, p)
            op = entry.operators[p]
            new_state = op.apply(state) if compose else state.float() + op.end
            tail = entry.conv_tails[p].to(conv.dtype)
            new_conv = torch.cat([conv, tail], dim=-1)[:, -conv.shape[-1] :]
            self.adapter.write_linear_state(cache, p, new_conv, new_state)
