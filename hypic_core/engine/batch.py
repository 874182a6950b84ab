"""The decode batch: every running sequence's cache stacked into one, advanced by one forward per step.

Layout. Row r holds sequence r. Attention K/V are left-padded: row r's `lengths[r]` real
columns are the last ones, so the column each step appends is the last for every row and the
layout survives decoding unchanged. A 4D mask hides the padding; each row gets its own
`position_ids` (its keys were rotated at their absolute positions when computed, so column
order does not matter to attention). Linear layers' conv and recurrent states are stacked
along the batch dimension. Membership changes (a sequence joins after prefill or leaves when
it finishes) rebuild the stacked cache once; steps in between only run the forward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .layers import AttentionLayers, LinearLayers, left_pad


class DecodeBatch:
    """Stacked caches of the running sequences. `keys` are the callers' sequence handles, in row order."""

    def __init__(self, model: torch.nn.Module, adapter, attention: AttentionLayers, linear: LinearLayers):
        self.model = model
        self.adapter = adapter
        self.attention = attention
        self.linear = linear
        self.keys: list[Any] = []
        self.lengths: list[int] = []  # real K/V columns per row
        self.cache = None

    def __len__(self) -> int:
        return len(self.keys)

    def sync(self, members: Sequence[Any], caches: dict[Any, Any]) -> None:
        """Make the rows exactly `members` (in that order where new): rows not in `members`
        leave; members not yet in the batch join with their own batch-1 cache from `caches`."""
        wanted, present = set(members), set(self.keys)
        keep = [i for i, k in enumerate(self.keys) if k in wanted]
        joining = [k for k in members if k not in present]
        if len(keep) == len(self.keys) and not joining:
            return
        parts_kv: list[tuple] = []  # per part: (keys per layer [b, H, L, D], values per layer, lengths)
        parts_lin: list = []
        if keep and self.cache is not None:
            idx = torch.tensor(keep, device=self.model.device)
            lengths = [self.lengths[i] for i in keep]
            width = max(lengths)
            keys, values = self.attention.kv(self.cache)
            parts_kv.append((tuple(k[idx, :, -width:] for k in keys), tuple(v[idx, :, -width:] for v in values), lengths))
            parts_lin.append(tuple((c[idx], s[idx]) for c, s in self.linear.rows(self.cache)))
        for k in joining:
            cache = caches[k]
            keys, values = self.attention.kv(cache)
            parts_kv.append((keys, values, [self.attention.length(cache)]))
            parts_lin.append(self.linear.rows(cache))
        self.keys = [self.keys[i] for i in keep] + joining
        self.lengths = [n for _, _, ns in parts_kv for n in ns]
        self.cache = None
        if not self.keys:
            return
        width = max(self.lengths)
        cache = self.adapter.new_cache()
        n_attn = len(self.attention)
        self.attention.append(
            cache,
            [torch.cat([left_pad(p[0][j], width) for p in parts_kv]) for j in range(n_attn)],
            [torch.cat([left_pad(p[1][j], width) for p in parts_kv]) for j in range(n_attn)],
        )
        self.linear.put_rows(cache, tuple(
            (torch.cat([p[l][0] for p in parts_lin]), torch.cat([p[l][1] for p in parts_lin])) for l in range(len(self.linear))
        ))
        self.cache = cache

    def forward(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed row r the token `token_ids[r]` at `positions[r]`; return next-token logits [B, vocab] (fp32)."""
        dev = self.model.device
        width = max(self.lengths) if self.lengths else 0
        lengths = torch.tensor(self.lengths, device=dev)
        cols = torch.arange(width + 1, device=dev)
        mask = (cols[None, :] >= (width - lengths)[:, None])[:, None, None, :]  # [B, 1, 1, width + 1]
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)[:, None]
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)[:, None]
        out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                         attention_mask=self.adapter.mask_argument(mask), logits_to_keep=1)
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1].float()
