"""The decode batch: every running sequence's cache as one row of preallocated slots, advanced by one forward per step.

Layout. Row r holds sequence r. Each attention layer's K/V live in one preallocated buffer
[rows, H_kv, columns, D]; row r's `lengths[r]` real columns are its first ones, and a decode
step writes each row's new key and value in place at column `lengths[r]` (the attention layers'
cache `update` is pointed at the buffer). Attention reads columns [0, max length], a 4D mask
hides each row's unused ones; each row gets its own `position_ids` (keys were rotated at their
absolute positions when computed, so column order does not matter to attention). So a step
copies no K/V, a sequence that joins copies only its own K/V into a free row, and one that
leaves has the last row moved into its place (one row copied). The buffers double when full
(rows or columns), a copy amortised over the steps that filled them. Linear layers' conv and
recurrent states (a fixed size per sequence) are stacked along the batch dimension and rebuilt
on a membership change. The plain reference is one sequence per forward on its own cache
(`ModelRunner.forward`), which tests/test_batching.py compares step by step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .layers import AttentionLayers, LinearLayers


class DecodeBatch:
    """Stacked caches of the running sequences. `keys` are the callers' sequence handles, in row order."""

    def __init__(self, model: torch.nn.Module, adapter, attention: AttentionLayers, linear: LinearLayers):
        self.model = model
        self.adapter = adapter
        self.attention = attention
        self.linear = linear
        self.keys: list[Any] = []
        self.lengths: list[int] = []  # real K/V columns per row
        self.cache = None  # the transformers cache the forward runs on (linear rows; attention points at the buffers)
        self._k: list[torch.Tensor] = []  # per attention layer [row capacity, H, column capacity, D]
        self._v: list[torch.Tensor] = []
        self._step: tuple | None = None  # during a forward: (rows, columns to write, read width, one column for all)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the buffers hold now."""
        return (self._k[0].shape[0], self._k[0].shape[2]) if self._k else (0, 0)

    def sync(self, members: Sequence[Any], caches: dict[Any, Any]) -> None:
        """Make the rows exactly `members`: rows not in `members` leave; members not yet in the batch
        join (at the end) with their own batch-1 cache from `caches`."""
        wanted, present = set(members), set(self.keys)
        joining = [k for k in members if k not in present]
        if all(k in wanted for k in self.keys) and not joining:
            return
        old_linear = self.linear.rows(self.cache) if self.cache is not None and self.keys else ()
        source = list(range(len(self.keys)))  # the old row each kept row's linear state comes from
        for r in reversed(range(len(self.keys))):
            if self.keys[r] not in wanted:
                self._drop(r, source)
        kept = len(self.keys)
        new_linear = []
        for k in joining:
            cache = caches[k]
            keys, values = self.attention.kv(cache)
            self._append(k, keys, values, self.attention.length(cache))
            new_linear.append(self.linear.rows(cache))
        self.cache = None
        if not self.keys:
            self._k, self._v = [], []  # nothing running: hold no memory
            return
        idx = torch.tensor(source[:kept], dtype=torch.long, device=self.model.device)
        rows = []
        for p in range(len(self.linear)):
            parts_conv = ([old_linear[p][0][idx]] if kept else []) + [lin[p][0] for lin in new_linear]
            parts_state = ([old_linear[p][1][idx]] if kept else []) + [lin[p][1] for lin in new_linear]
            rows.append((torch.cat(parts_conv), torch.cat(parts_state)))
        cache = self.adapter.new_cache()
        self.linear.put_rows(cache, tuple(rows))
        for j, i in enumerate(self.attention.indices):
            if i >= len(cache.layers):  # a lazily built cache makes its layers on a first update
                cache.update(self._k[j][:1, :, :0], self._v[j][:1, :, :0], i)
            layer = cache.layers[i]
            layer.is_initialized, layer.device = True, self.model.device
            layer.update = _SlotUpdate(self, j)  # the instance's update writes into the buffers
        self.cache = cache
        self._point(max(self.lengths))

    def forward(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed row r the token `token_ids[r]` at `positions[r]`; return next-token logits [B, vocab] (fp32)."""
        dev = self.model.device
        width = max(self.lengths) + 1
        self.reserve(len(self.keys), width)
        cols = torch.tensor(self.lengths, dtype=torch.long, device=dev)
        same = self.lengths[0] if min(self.lengths) == width - 1 else None  # every row writes the same column
        self._step = (torch.arange(len(self.keys), device=dev), cols, width, same)
        self._point(width - 1)
        mask = (torch.arange(width, device=dev)[None, :] <= cols[:, None])[:, None, None, :]  # [B, 1, 1, width]
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)[:, None]
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)[:, None]
        try:
            out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                             attention_mask=self.adapter.mask_argument(mask), logits_to_keep=1)
        finally:
            self._step = None
        self.lengths = [n + 1 for n in self.lengths]
        self._point(width)
        return out.logits[:, -1].float()

    # --- slots -------------------------------------------------------------------------------
    def _write(self, j: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Attention layer j's cache update during a forward: each row's new column in place; returns
        the columns attention reads."""
        rows, cols, width, same = self._step
        b = len(rows)
        if same is not None:
            self._k[j][:b, :, same:same + 1] = key_states
            self._v[j][:b, :, same:same + 1] = value_states
        else:
            self._k[j][rows, :, cols] = key_states[:, :, 0]
            self._v[j][rows, :, cols] = value_states[:, :, 0]
        return self._k[j][:b, :, :width], self._v[j][:b, :, :width]

    def _point(self, width: int) -> None:
        """Show the cache's attention layers the buffers' first `width` columns (their sequence length)."""
        b = len(self.keys)
        for j, i in enumerate(self.attention.indices):
            layer = self.cache.layers[i]
            layer.keys, layer.values = self._k[j][:b, :, :width], self._v[j][:b, :, :width]

    def _append(self, key: Any, keys, values, length: int) -> None:
        """A new last row with a batch-1 cache's K/V ([1, H, length, D] per layer)."""
        r = len(self.keys)
        if not self._k:
            self._k = [torch.zeros((1, k.shape[1], max(1, length + 1), k.shape[3]), dtype=k.dtype, device=k.device)
                       for k in keys]
            self._v = [torch.zeros((1, v.shape[1], max(1, length + 1), v.shape[3]), dtype=v.dtype, device=v.device)
                       for v in values]
        self.reserve(r + 1, length + 1)
        for j in range(len(self._k)):
            self._k[j][r, :, :length] = keys[j][0, :, :length]
            self._v[j][r, :, :length] = values[j][0, :, :length]
        self.keys.append(key)
        self.lengths.append(length)

    def _drop(self, r: int, source: list[int]) -> None:
        """Remove row r: the last row moves into its place (one row copied)."""
        last = len(self.keys) - 1
        if r != last:
            n = self.lengths[last]
            for j in range(len(self._k)):
                self._k[j][r, :, :n] = self._k[j][last, :, :n]
                self._v[j][r, :, :n] = self._v[j][last, :, :n]
            self.keys[r], self.lengths[r], source[r] = self.keys[last], self.lengths[last], source[last]
        self.keys.pop()
        self.lengths.pop()
        source.pop()

    def reserve(self, rows: int, cols: int) -> None:
        """Grow the buffers (doubling) to hold at least `rows` rows and `cols` columns."""
        have_rows, have_cols = self.capacity
        if rows <= have_rows and cols <= have_cols:
            return
        new_rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        new_cols = max(cols, min(2 * have_cols, self.adapter.max_positions)) if cols > have_cols else have_cols
        b = len(self.keys)
        n = max(self.lengths, default=0)
        for bufs in (self._k, self._v):
            for j, old in enumerate(bufs):
                new = torch.zeros((new_rows, old.shape[1], new_cols, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:b, :, :n] = old[:b, :, :n]
                bufs[j] = new


class _SlotUpdate:
    """Bound as a cache layer's `update`: the batch writes the step's K/V into its buffers."""

    def __init__(self, batch: DecodeBatch, j: int):
        self.batch, self.j = batch, j

    def __call__(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.batch._write(self.j, key_states, value_states)
