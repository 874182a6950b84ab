"""The verification forward of speculative decoding: row r of a `DecodeBatch` fed n_r tokens at once.

Row r's tokens are its last sampled token and its draft (hypic_core/engine/drafting.py); one forward
gives the logits after each, and the engine keeps per row the longest prefix the model agrees with
(`commit`). Everything before that point must be exactly what plain decoding would have left, and
nothing after it may survive:

- **attention**: row r's new K/V are written at columns lengths[r].. and read causally; keeping a
  prefix is setting `lengths[r]` (later columns are hidden, then overwritten).
- **linear layers** cannot be un-applied: the forward leaves their rows as they were and `commit`
  writes the state after the row's last kept token. Mamba2 (SSD) in closed form: the state after
  token t is the old one decayed plus a weighted sum of the new x_t B_t^T, so the outputs are one
  [T, T] product per head and `commit` forms only the state each row keeps (`_SSDStates`). Gated
  DeltaNet's delta rule has no such form: stepped token by token with the lean step's update, every
  state kept (`_TokenStates`). The conv state after token t is read off the old conv state and the
  new inputs. No snapshot, no second forward.

The forward is the lean step's own (`LeanDecodeStep.forward`: the same layers, projections, norms,
attention and MLPs on the same op table, runner/ops.py) on the flat list of real tokens; only the
linear mixers' multi-token recurrences are this module's (on a padded [B, T] layout). Reference: the
same tokens fed one at a time through the lean step (tests/engine/test_speculation.py, every family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .decode_step import LeanDecodeStep, Mamba2, causal_conv


@dataclass
class Verified:
    """One verification forward's result: logits [B, T, vocab] (fp32; row r's first n_r are real) and
    what `commit` needs to keep a prefix of each row."""

    logits: torch.Tensor
    counts: list[int]  # n_r: tokens fed to row r
    conv: list[torch.Tensor]  # per linear layer: [B, C, K + T], old conv state then the new inputs
    states: list["_TokenStates | _SSDStates"]  # per linear layer: the state after any token, `.at(index)`


class _TokenStates:
    """A recurrence stepped token by token: every state kept, `at` picks one per row."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states  # T states [B, ...]: the state after each token

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """Row r's state after its token index[r]: [B, ...]."""
        return torch.stack(self.states)[index, torch.arange(index.shape[0])]


class _SSDStates:
    """Mamba2's state after any of a verification's tokens, in closed form from the state before them.

    S0 [B, H, P, N] is the rows' state buffer as the forward found it (a view: `commit` reads it
    before writing the kept state over it); dt [B, H, T] the effective step sizes, cum their
    running sum times A (the log decay), x [B, H, T, P] and Bh [B, H, T, N] fp32."""

    def __init__(self, S0: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, x: torch.Tensor, Bg: torch.Tensor, per_group: int):
        self.S0 = S0
        self.dt = dt.float().transpose(1, 2)  # [B, H, T]
        self.cum = torch.cumsum(self.dt * A[:, None], dim=-1)  # [B, H, T]
        self.x = x.float().permute(0, 2, 1, 3)  # [B, H, T, P]
        self.Bh = Bg.float().repeat_interleave(per_group, dim=2)  # [B, T, H, N]

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """S_k = exp(c_k) S0 + sum_{s<=k} exp(c_k - c_s) dt_s x_s B_s^T at k = index[r] per row: [B, H, P, N]."""
        B, H, T = self.cum.shape
        index = index.to(self.cum.device)
        end = self.cum.gather(2, index.view(B, 1, 1).expand(B, H, 1))  # [B, H, 1]: c_k
        upto = torch.arange(T, device=index.device)[None, :] <= index[:, None]  # [B, T]
        weight = ((end - self.cum).exp() * self.dt).masked_fill(~upto[:, None, :], 0.0)  # [B, H, T]
        added = torch.matmul((self.x * weight[..., None]).transpose(-1, -2), self.Bh.transpose(1, 2))  # [B, H, P, N]
        return (self.S0.float() * end.exp()[..., None] + added).to(self.S0.dtype)


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
            recurrence = self._mamba2 if isinstance(mixer, Mamba2) else self._gated_deltanet
            return recurrence(mixer, x, rows.batch, lay, conv_out, states_out)

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

    # --- the linear mixers' multi-token recurrences ------------------------------------------------
    @staticmethod
    def _conv(conv: torch.Tensor, x: torch.Tensor, weight, bias, conv_out: list) -> torch.Tensor:
        """`causal_conv` of the new inputs x [B, T, C] after the conv rows (left as they were), its inputs kept."""
        out, seq = causal_conv(conv, x, weight, bias)
        conv_out.append(seq)
        return out

    def _mamba2(self, m: Mamba2, x, batch, lay: _Layout, conv_out: list, states_out: list) -> torch.Tensor:
        """The SSD recurrence over each row's T new tokens in closed form, not token by token: with
        c_t = sum_{s<=t} dt_s a (the log decay), the state after token t is
        S_t = exp(c_t) S_0 + sum_{s<=t} exp(c_t - c_s) dt_s x_s B_s^T, so every output
        y_t = C_t S_t + D x_t is one [T, T] product per head plus S_0's share, and no per-token state
        is formed here: `_SSDStates` forms the one state a row keeps when `commit` asks for it."""
        B, T, H, P, G, N = lay.b, lay.t, m.H, m.P, m.G, m.N
        ops, dtype = self.lean.ops, x.dtype
        conv, state = batch.linear_layer(m.p)
        gate, xbc, dt = ops.linear(x, m.in_proj).split([m.I, m.C, H], dim=-1)
        xbc = self._conv(conv, lay.pad(xbc), m.conv_w, m.conv_b, conv_out)  # [B, T, C]
        hs, Bm, Cm = xbc.split([m.I, G * N, G * N], dim=-1)
        dt = F.softplus(lay.pad(dt) + m.dt_bias.to(dt.dtype))  # [B, T, H]
        ssd = _SSDStates(state, dt, m.A, hs.reshape(B, T, H, P), Bm.reshape(B, T, G, N), H // G)
        Ch = Cm.reshape(B, T, G, N).float().permute(0, 2, 1, 3).repeat_interleave(H // G, dim=1)  # [B, H, T, N]
        Bh = ssd.Bh.permute(0, 2, 1, 3)  # [B, H, T, N]
        decay = (ssd.cum[..., :, None] - ssd.cum[..., None, :]).masked_fill_(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril_(), float("-inf")).exp_()  # [B, H, t, s]
        mix = torch.matmul(Ch, Bh.transpose(-1, -2)) * decay * ssd.dt[..., None, :]  # [B, H, t, s]: C_t.B_s exp(c_t - c_s) dt_s
        y = torch.matmul(mix, ssd.x)  # [B, H, T, P]
        y = y + torch.matmul(Ch, ssd.S0.float().transpose(-1, -2)) * ssd.cum.exp()[..., None]  # S_0's share: exp(c_t) C_t S_0
        y = y.to(dtype) + hs.reshape(B, T, H, P).permute(0, 2, 1, 3) * m.D[:, None, None]
        states_out.append(ssd)
        y = m.gated_norm(lay.unpad(y.permute(0, 2, 1, 3)).reshape(-1, H * P), gate, dtype)
        return ops.linear(y, m.out_proj)

    def _gated_deltanet(self, m, x, batch, lay: _Layout, conv_out: list, states_out: list) -> torch.Tensor:
        """The delta rule stepped token by token over the padded [B, T] layout, every state kept."""
        T, Hv = lay.t, m.Hv
        ops = self.lean.ops
        conv, state = batch.linear_layer(m.p)
        qkv, z, b, a = ops.linear(x, m.in_proj).split([m.C, m.value_dim, Hv, Hv], dim=-1)
        qkv = self._conv(conv, lay.pad(qkv), m.conv_w, m.conv_b, conv_out)  # [B, T, C]
        q, k, v, beta, g = m.heads(qkv, lay.pad(b), lay.pad(a))
        S = state.float()
        states, outs = [], []
        for t in range(T):
            S, out = m.delta(S, q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t])
            states.append(S)
            outs.append(out)
        states_out.append(_TokenStates(states))
        return m.output(lay.unpad(torch.stack(outs, dim=1)), z, ops)
