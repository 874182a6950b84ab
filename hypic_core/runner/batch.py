"""The decode batch: every running sequence as one row of preallocated slots, advanced by one forward per step.

Row r holds sequence r. Each attention layer's K/V live in one buffer [rows, H_kv, columns, D] with
room to spare, row r's `lengths[r]` real columns first; a step writes each row's new key and value in
place at column `lengths[r]` and attention reads the live columns [0, max length + 1) under a mask,
each row at its own `position_ids` (keys were rotated at their absolute positions). Linear layers'
conv and recurrent states live in row buffers the forward updates in place. So a step copies no K/V,
a sequence that joins copies only its own K/V and states into the next free row, and one that leaves
has the last row moved into its place. Buffers grow by half when full (rows or columns) and are freed
when nothing runs. A family whose cache replaces a linear state with a new tensor each step
(MiniMax) has that tensor adopted as the layer's buffer. A lean decode step (runner/decode_step.py)
reads and writes the buffers through `attention_layer(j)` / `linear_layer(p)` and `advance`.

The plain reference is one sequence per forward on its own cache (`ModelRunner.forward`),
which tests/engine/test_batching.py compares step by step over joins and leaves.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import torch

from .layers import AttentionLayers, LinearLayers

_GRAIN = 64  # K/V column capacity is a multiple of this


class KVRows(NamedTuple):
    """An attention layer's K/V row buffers, [row capacity, H_kv, column capacity, D] each: row r's first
    `lengths[r]` columns are live; a step writes its new columns in place."""

    keys: torch.Tensor
    values: torch.Tensor

    def write(self, k: torch.Tensor, v: torch.Tensor, row, col, same: int | None) -> None:
        """The new tokens' k and v [N, H_kv, D] in place: token i at column col[i] of row row[i], or, when
        `same` is set, token i at column `same` of row i (one slice, no gather: every row writes there)."""
        if same is not None:
            self.keys[:len(k), :, same], self.values[:len(v), :, same] = k, v
        else:
            self.keys[row, :, col], self.values[row, :, col] = k, v


class StateRows(NamedTuple):
    """A linear layer's live rows (views, advanced in place): conv [B, C, K] and recurrent state [B, ...]."""

    conv: torch.Tensor
    state: torch.Tensor


class DecodeBatch:
    """Row slots of the running sequences. `keys` are the callers' sequence handles, in row order."""

    def __init__(self, model: torch.nn.Module, adapter, attention: AttentionLayers, linear: LinearLayers, step=None):
        self.model = model
        self.adapter = adapter
        self.attention = attention
        self.linear = linear
        self.step = step  # a lean decode step (runner/decode_step.py) run instead of the model's forward; None: the module path
        self.keys: list[Any] = []
        self.lengths: list[int] = []  # real K/V columns per row
        self.cache = None  # the transformers cache the forward runs on; its layers point at the buffers
        self._k: list[torch.Tensor] = []  # per attention layer [row capacity, H, column capacity, D]
        self._v: list[torch.Tensor] = []
        self._conv: list[torch.Tensor] = []  # per linear layer [row capacity, C, K]
        self._state: list[torch.Tensor] = []  # per linear layer [row capacity, ...]
        self._step: tuple | None = None  # during a forward: (rows, columns to write, read width, one column for all)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the K/V buffers hold now."""
        return (self._k[0].shape[0], self._k[0].shape[2]) if self._k else (0, 0)

    @property
    def layer_counts(self) -> tuple[int, int]:
        """(attention layers, linear layers) the batch holds row buffers for."""
        return len(self._k), len(self._conv)

    def attention_layer(self, j: int) -> KVRows:
        """Attention layer j's K/V row buffers (the batch's own: a decode step writes into them)."""
        return KVRows(self._k[j], self._v[j])

    def linear_layer(self, p: int) -> StateRows:
        """Linear layer p's conv and state rows of the running sequences (views of the batch's buffers)."""
        b = len(self.keys)
        return StateRows(self._conv[p][:b], self._state[p][:b])

    def advance(self, counts: Sequence[int]) -> None:
        """Row r keeps `counts[r]` more K/V columns (written by a step): its length grows by as many."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self._point(max(self.lengths))

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the rows live in (tests check they stay in place)."""
        return [*self._k, *self._v, *self._conv, *self._state]

    # --- membership --------------------------------------------------------------------------
    def sync(self, members: Sequence[Any], caches: dict[Any, Any]) -> None:
        """Make the rows exactly `members`: rows not in `members` leave; members not yet in the batch
        join (at the end) with their own batch-1 cache from `caches`."""
        wanted, present = set(members), set(self.keys)
        joining = [k for k in members if k not in present]
        if not joining and all(k in wanted for k in self.keys):
            return
        for r in reversed(range(len(self.keys))):
            if self.keys[r] not in wanted:
                self._drop(r)
        if not self.keys and not joining:
            self._free()
            return
        if joining:
            if self.cache is None:  # first rows since the batch was empty: zero-row buffers, grown below
                keys, values = self.attention.kv(caches[joining[0]])
                self._k = [k.new_zeros((0, k.shape[1], 0, k.shape[3])) for k in keys]
                self._v = [v.new_zeros((0, v.shape[1], 0, v.shape[3])) for v in values]
                rows = self.linear.rows(caches[joining[0]])
                self._conv = [c.new_zeros((0, *c.shape[1:])) for c, _ in rows]
                self._state = [s.new_zeros((0, *s.shape[1:])) for _, s in rows]
                self.cache = self.adapter.new_cache()
            longest = max(self.lengths + [self.attention.length(caches[k]) for k in joining])
            self.reserve(len(self.keys) + len(joining), longest + 1)  # once for all that join
            for k in joining:
                self._add(k, caches[k])
        self._bind()

    def _add(self, key: Any, cache) -> None:
        """A new last row (room reserved) with a batch-1 cache's K/V ([1, H, length, D] per layer) and linear states."""
        keys, values = self.attention.kv(cache)
        length = self.attention.length(cache)
        rows = self.linear.rows(cache)
        r = len(self.keys)
        for j in range(len(self._k)):
            self._k[j][r, :, :length] = keys[j][0, :, :length]
            self._v[j][r, :, :length] = values[j][0, :, :length]
        for p, (conv, state) in enumerate(rows):
            self._conv[p][r] = conv[0]
            self._state[p][r] = state[0]
        self.keys.append(key)
        self.lengths.append(length)

    def _drop(self, r: int) -> None:
        """Remove row r: the last row moves into its place (one row copied)."""
        last = len(self.keys) - 1
        if r != last:
            n = self.lengths[last]
            for j in range(len(self._k)):
                self._k[j][r, :, :n] = self._k[j][last, :, :n]
                self._v[j][r, :, :n] = self._v[j][last, :, :n]
            for bufs in (self._conv, self._state):
                for buf in bufs:
                    buf[r] = buf[last]
            self.keys[r], self.lengths[r] = self.keys[last], self.lengths[last]
        self.keys.pop()
        self.lengths.pop()

    def _free(self) -> None:
        """Nothing running: hold no memory."""
        self._k, self._v, self._conv, self._state = [], [], [], []
        self.cache = None

    def _bind(self) -> None:
        """Point the cache's layers at the buffers' live rows."""
        b, cache = len(self.keys), self.cache
        for p in range(len(self.linear)):
            self.adapter.bind_linear_rows(cache, p, self._conv[p][:b], self._state[p][:b])
        for j, i in enumerate(self.attention.indices):
            if i >= len(cache.layers):  # a lazily built cache makes its layers on a first update
                cache.update(self._k[j][:1, :, :0], self._v[j][:1, :, :0], i)
            layer = cache.layers[i]
            if getattr(layer.__dict__.get("update"), "func", None) != self._write:
                layer.is_initialized, layer.device = True, self.model.device
                layer.update = functools.partial(self._write, j)  # the instance's update writes into the buffers
        self._point(max(self.lengths))

    def reserve(self, rows: int, cols: int) -> None:
        """Grow the buffers to hold at least `rows` rows and `cols` columns: by half, columns rounded up
        to a multiple of `_GRAIN` (never past the model's context)."""
        have_rows, have_cols = self.capacity
        new_rows = max(rows, have_rows + have_rows // 2) if rows > have_rows else have_rows
        new_cols = have_cols
        if cols > have_cols:
            grown = -(-max(cols + 1, have_cols + have_cols // 2) // _GRAIN) * _GRAIN
            new_cols = max(cols, min(grown, self.adapter.max_positions))
        b, moved = len(self.keys), False
        if (new_rows, new_cols) != (have_rows, have_cols):
            n, moved = max(self.lengths, default=0), True
            for bufs in (self._k, self._v):
                for j, old in enumerate(bufs):
                    new = old.new_zeros((new_rows, old.shape[1], new_cols, old.shape[3]))
                    new[:b, :, :n] = old[:b, :, :n]
                    bufs[j] = new
        for bufs in (self._conv, self._state):  # row capacity per layer (an adopted state holds only the live rows)
            for p, old in enumerate(bufs):
                if old.shape[0] < rows:
                    new = old.new_zeros((max(rows, new_rows), *old.shape[1:]))
                    new[:b] = old[:b]
                    bufs[p] = new
                    moved = True
        if moved and b:
            self._bind()

    # --- a step ------------------------------------------------------------------------------
    def forward(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed row r the token `token_ids[r]` at `positions[r]`; return next-token logits [B, vocab] (fp32)."""
        dev = self.model.device
        b = len(self.keys)
        width = max(self.lengths) + 1
        self.reserve(b, width)
        if self.step is not None:  # writes each row's new column into the buffers itself
            logits = self.step(self, token_ids, positions)
            self.advance([1] * b)
            return logits
        cols = torch.tensor(self.lengths, dtype=torch.long, device=dev)
        same = self.lengths[0] if min(self.lengths) == width - 1 else None  # every row writes the same column
        self._step = (torch.arange(b, device=dev), cols, width, same)
        mask = (torch.arange(width, device=dev)[None, :] <= cols[:, None])[:, None, None, :]  # [B, 1, 1, width]
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)[:, None]
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)[:, None]
        try:
            out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                             attention_mask=self.adapter.mask_argument(mask), logits_to_keep=1)
        finally:
            self._step = None
        self.advance([1] * b)
        self._adopt()
        return out.logits[:, -1].float()

    def _write(self, j: int, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Attention layer j's cache update during a forward: each row's new column in place; returns
        the live columns attention reads."""
        rows, cols, width, same = self._step
        b = len(rows)
        self.attention_layer(j).write(key_states[:, :, 0], value_states[:, :, 0], rows, cols, same)
        return self._k[j][:b, :, :width], self._v[j][:b, :, :width]

    def _point(self, width: int) -> None:
        """Show the cache's attention layers the buffers' first `width` columns (their sequence length)."""
        b = len(self.keys)
        for j, i in enumerate(self.attention.indices):
            layer = self.cache.layers[i]
            layer.keys, layer.values = self._k[j][:b, :, :width], self._v[j][:b, :, :width]

    def _adopt(self) -> None:
        """A linear layer whose cache put a new tensor in place of the bound rows: that tensor is the buffer now."""
        for p in range(len(self.linear)):
            conv, state = self.adapter.linear_rows(self.cache, p)
            if state.data_ptr() != self._state[p].data_ptr():
                self._state[p] = state
            if conv.numel() and conv.data_ptr() != self._conv[p].data_ptr():
                self._conv[p] = conv

