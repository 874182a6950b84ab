"""The verification forward of speculative decoding: row r of a `DecodeBatch` fed n_r tokens at once.

Row r's tokens are its last sampled token and its draft (hypic_core/engine/drafting.py); one forward
gives the logits after each, and the engine keeps per row the longest prefix the model agrees with
(`commit`). Everything before that point must be exactly what plain decoding would have left, and
nothing after it may survive:

- **attention**: row r's new K/V are written at columns lengths[r].. and read causally; keeping a
  prefix is setting `lengths[r]` (later columns are hidden, then overwritten).
- **linear layers** cannot be un-applied: the forward leaves their rows as they were and `commit`
  writes the state after the row's last kept token. Mamba2 (SSD), on torch's op table, in closed
  form: the state after token t is the old one decayed plus a weighted sum of the new x_t B_t^T, so
  the outputs are one [T, T] product per head and `commit` forms only the state each row keeps; on
  the native kernels, stepped through the plain step's one-token update on copies of the rows (one
  call per token, where the closed form is ~20 small ops), every state kept. Gated DeltaNet's delta
  rule has no such form: stepped token by token with the lean step's update, every state kept. The
  conv state after token t is read off the old conv state and the new inputs. No snapshot, no
  second forward.

The forward is the lean step's own (`LeanDecodeStep.forward`: the same layers, projections, norms,
attention and MLPs on the same op table, runner/ops.py) on the flat list of real tokens; the linear
mixers' multi-token recurrences live with their families in runner/decode_step.py (`Mamba2.verify`,
`GatedDeltaNet.verify`, on this module's padded [B, T] `_Layout`). Reference: the same tokens fed
one at a time through the lean step (tests/engine/test_speculation.py, every family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .decode_step import LeanDecodeStep


@dataclass
class Verified:
    """One verification forward's result: logits [B, T, vocab] (fp32; row r's first n_r are real) and
    what `commit` needs to keep a prefix of each row."""

    logits: torch.Tensor
    counts: list[int]  # n_r: tokens fed to row r
    conv: list[torch.Tensor]  # per linear layer: [B, C, K + T], old conv state then the new inputs
    states: list  # per linear layer: the state after any token, `.at(index)` (its family's `verify` made it)


class _Layout:
    """Rows of different lengths as one flat list of real tokens and as a padded [B, T] grid."""

    def __init__(self, counts: Sequence[int], device):
        self.b, self.t = len(counts), max(counts)
        steps = torch.arange(self.t, device=device)
        real = steps[None, :] < torch.tensor(list(counts), device=device)[:, None]  # [B, T]
        self.flat = real.reshape(-1).nonzero()[:, 0]  # grid index of each real token

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat [N, ...] -> padded [B, T, ...] (zeros where a row has no token)."""
        out = x.new_zeros((self.b * self.t, *x.shape[1:]))
        out[self.flat] = x
        return out.view(self.b, self.t, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded [B, T, ...] -> flat [N, ...]."""
        return x.reshape(self.b * self.t, *x.shape[2:])[self.flat]


class VerifyStep:
    """`verify(batch, tokens, positions) -> Verified` and `commit(batch, verified, kept)` on a lean step."""

    def __init__(self, lean: LeanDecodeStep):
        self.lean = lean

    @classmethod
    def build(cls, batch) -> "VerifyStep | None":
        """For a batch that decodes on the lean step; None otherwise (no speculation then)."""
        return cls(batch.step) if isinstance(batch.step, LeanDecodeStep) else None

    def verify(self, batch, tokens: Sequence[Sequence[int]], positions: Sequence[int]) -> Verified:
        """Feed row r the tokens `tokens[r]` (at least one) from position `positions[r]`. Writes their K/V
        into the rows' free columns; leaves `lengths` and the linear state buffers as they were."""
        counts = [len(t) for t in tokens]
        if len(counts) != len(batch.keys) or min(counts) < 1:
            raise ValueError("verify needs one or more tokens for every row of the batch")
        batch.reserve(len(counts), max(batch.lengths) + max(counts) + 1)
        lay = _Layout(counts, self.lean.embed.device)
        conv_out: list[torch.Tensor] = []
        states_out: list = []

        def linear(mixer, x, rows):
            return mixer.verify(x, rows, self.lean.ops, lay, conv_out, states_out)

        logits = self.lean.forward(batch, tokens, positions, linear=linear)
        return Verified(lay.pad(logits), counts, conv_out, states_out)

    @staticmethod
    def commit(batch, verified: Verified, kept: Sequence[int]) -> None:
        """Keep the first `kept[r]` (1..n_r) tokens of row r: its K/V columns, and the conv and recurrent
        state after its last kept token."""
        b = len(kept)
        if any(not 1 <= k <= n for k, n in zip(kept, verified.counts)) or b != len(batch.keys):
            raise ValueError(f"kept {list(kept)} must be within 1..{verified.counts} per row")
        index = torch.tensor([k - 1 for k in kept], dtype=torch.long)
        for p, (conv, states) in enumerate(zip(verified.conv, verified.states)):
            rows = batch.linear_layer(p)
            width = rows.conv.shape[-1]
            picked = torch.stack([conv[r, :, int(index[r]) + 1:int(index[r]) + 1 + width] for r in range(b)])
            rows.conv.copy_(picked.to(rows.conv.dtype))
            rows.state.copy_(states.at(index).to(rows.state.dtype))
        batch.advance(kept)
