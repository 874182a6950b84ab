"""One manager per layer kind: every loop over a model's attention or linear layers lives here.

`AttentionLayers` moves K/V in and out of a transformers cache (append, slice, snapshot,
restore, batch rows); `LinearLayers` does the same for linear layers' conv and recurrent
states and applies a cached segment's body (S <- T S + E, conv tail shifted in). Both read
the layer lists and the family-specific state access from the model's adapter, so adding a
family never touches these loops.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..adapters import ModelAdapter
from ..algebra.entry import SegmentEntry

KV = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]  # (keys, values), one tensor per attention layer
LinearRows = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (conv, state) per linear layer


def scaled(keys: torch.Tensor, key_scale: float) -> torch.Tensor:
    """`keys` x `key_scale` (the same tensor at 1.0). A query's logit on a key is linear in it, so this
    is a temperature of 1 / key_scale on the logits of these keys alone (rotary embedding commutes)."""
    return keys if key_scale == 1.0 else keys * key_scale


class AttentionLayers:
    """The full-attention layers of one model. Tensors are [B, H_kv, L, D] unless noted."""

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter
        self.indices = list(adapter.attention_layers)

    def __len__(self) -> int:
        return len(self.indices)

    def kv(self, cache) -> KV:
        """Every attention layer's keys and values in `cache` (views, not copies)."""
        return (tuple(cache.layers[i].keys for i in self.indices), tuple(cache.layers[i].values for i in self.indices))

    def length(self, cache) -> int:
        """Cached tokens (columns) of the first attention layer; 0 for an empty cache."""
        layer = cache.layers[self.indices[0]]
        keys = getattr(layer, "keys", None)
        return 0 if keys is None or keys.numel() == 0 else int(keys.shape[-2])

    def append(self, cache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append K/V columns to every attention layer (creates the layers of a lazily built cache)."""
        for i, k, v in zip(self.indices, keys, values):
            cache.update(k, v, i)

    def append_body(self, cache, entry: SegmentEntry, offset: int, key_scale: float = 1.0) -> None:
        """Append `entry`'s body K/V, keys rotated from local positions to the segment's `offset` and
        multiplied by `key_scale` (every later query's logits on them scaled alike)."""
        self.append(cache, [scaled(self.adapter.rotate_keys(k, offset), key_scale)[None] for k in entry.keys],
                    [v[None] for v in entry.values])

    def scale_keys(self, cache, spans: Sequence[tuple[int, int]], factor: float) -> None:
        """Multiply the keys of columns [a, b) of every span, in every attention layer, by `factor` (in place)."""
        with torch.inference_mode():
            for keys in self.kv(cache)[0]:
                for a, b in spans:
                    keys[:, :, a:b] *= factor

    def slice(self, cache, row: int, start: int, end: int) -> KV:
        """Copies of row `row`'s columns [start, end), [H_kv, end - start, D] per layer."""
        keys, values = self.kv(cache)
        return tuple(k[row, :, start:end].clone() for k in keys), tuple(v[row, :, start:end].clone() for v in values)


class LinearLayers:
    """The linear (recurrent) layers of one model: conv state [C, K] and recurrent state per row."""

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter

    def __len__(self) -> int:
        return len(self.adapter.linear_layers)

    def zero_start(self, cache) -> None:
        """Give every linear layer of a fresh cache a zero state (row 0)."""
        for p in range(len(self)):
            self.adapter.linear_state_or_zero(cache, p)

    def snapshot(self, cache) -> LinearRows:
        """Copies of every layer's (conv, state) of row 0."""
        return tuple(tuple(x.clone() for x in self.adapter.linear_state_or_zero(cache, p)) for p in range(len(self)))

    def restore(self, cache, snap: LinearRows) -> None:
        """Write a `snapshot` back into row 0 (initialising layers of a fresh cache)."""
        for p, (conv, state) in enumerate(snap):
            self.adapter.linear_state_or_zero(cache, p)
            self.adapter.write_linear_state(cache, p, conv, state)

    def append_body(self, cache, entry: SegmentEntry, transition: bool = True) -> None:
        """Advance every layer over `entry`'s body: S <- T S + E, or S <- S + E without `transition`
        (pic-naive ignores it); the segment's conv tail is shifted into the conv state."""
        for p in range(len(self)):
            conv, state = self.adapter.linear_state_or_zero(cache, p)
            op = entry.operators[p]
            new_state = op.apply(state) if transition else state.float() + op.end
            tail = entry.conv_tails[p].to(conv.dtype)
            new_conv = torch.cat([conv, tail], dim=-1)[:, -conv.shape[-1]:]
            self.adapter.write_linear_state(cache, p, new_conv, new_state)

    def rows(self, cache) -> LinearRows:
        """Every layer's (conv [B, C, K], state [B, ...]) over all rows (views)."""
        return tuple(self.adapter.linear_rows(cache, p) for p in range(len(self)))
