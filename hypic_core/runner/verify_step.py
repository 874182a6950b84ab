"""The verification forward of speculative decoding: row r of a `DecodeBatch` fed n_r tokens at once.

Row r's tokens are its last sampled token followed by its draft tokens (hypic_core/engine/drafting.py).
One forward computes next-token logits after each of them; the engine then keeps, per row, the
longest prefix the model agrees with (`commit`). Everything before that point must be exactly
what plain decoding would have left, and nothing after it may survive:

- **attention**: row r's new keys and values are written at columns lengths[r].. and read under a
  causal mask; keeping a prefix is setting `lengths[r]` (later columns are hidden and overwritten).
- **linear layers** cannot be un-applied, so the forward leaves their state buffers as they were
  and `commit` writes the state after the row's last kept token. Mamba2 (SSD) needs no per-token
  state for that: the state after any token t is the old state decayed plus a weighted sum of
  the new tokens' x_t B_t^T, so the outputs come from one [T, T] product per head and `commit`
  forms only the one state each row keeps (`_SSDStates`). Gated DeltaNet's delta rule has no such
  short form; it is stepped token by token with the lean step's update and keeps the state after
  every token (`_TokenStates`, T states per layer, for one forward). The conv state after token t
  is the last K inputs up to t, read off the concatenation of the old conv state and the new
  inputs. Neither keeps a snapshot to re-run the kept tokens from: no second forward.

The expensive part, every weight matrix, runs once on the flat list of real tokens (no padding).
Attention runs row by row over each row's own live columns (a batched, padded product cost more
than the drafts saved once contexts were long); the recurrences step a padded [B, T] layout. Families: those of the
lean decode step (runner/decode_step.py); the engine does not speculate on the others.

Reference: feeding the same tokens one at a time through the lean step. tests/engine/test_speculation.py
compares logits and the kept states on every covered family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .decode_step import LeanDecodeStep, _mm, _rope


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

    def __init__(self, counts: Sequence[int], lengths: Sequence[int], device):
        self.b, self.t = len(counts), max(counts)
        self.counts, self.lengths = list(counts), list(lengths)
        counts_t = torch.tensor(list(counts), device=device)
        steps = torch.arange(self.t, device=device)
        self.real = steps[None, :] < counts_t[:, None]  # [B, T]
        self.flat = self.real.reshape(-1).nonzero()[:, 0]  # grid index of each real token
        lengths_t = torch.tensor(list(lengths), dtype=torch.long, device=device)
        self.cols = lengths_t[:, None] + steps[None, :]  # [B, T]: the column each token writes
        self._causal: dict[int, torch.Tensor] = {}
        self._lower: dict[int, torch.Tensor] = {}
        self.rows = torch.arange(self.b, device=device)[:, None].expand(self.b, self.t).reshape(-1)[self.flat]  # row of each real token
        self.cols_flat = self.cols.reshape(-1)[self.flat]  # column each real token writes

    def causal(self, n: int, dtype) -> torch.Tensor:
        """[n, n] additive mask: token t of a row's new tokens sees the new tokens up to itself."""
        if n not in self._causal:
            self._causal[n] = torch.full((n, n), float("-inf"), dtype=dtype).triu_(1)
        return self._causal[n]

    def lower(self, n: int) -> torch.Tensor:
        """[n, n] bool: token t sees tokens s <= t."""
        if n not in self._lower:
            self._lower[n] = torch.ones(n, n, dtype=torch.bool, device=self.cols.device).tril_()
        return self._lower[n]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat [N, ...] -> padded [B, T, ...] (zeros where a row has no token)."""
        out = x.new_zeros((self.b * self.t, *x.shape[1:]))
        out[self.flat] = x
        return out.view(self.b, self.t, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded [B, T, ...] -> flat [N, ...]."""
        return x.reshape(self.b * self.t, *x.shape[2:])[self.flat]


class VerifyStep:
    """`verify(batch, tokens, positions) -> Verified` and `commit(batch, verified, kept)` on a lean step's weights."""

    def __init__(self, lean: LeanDecodeStep):
        self.lean = lean

    @classmethod
    def build(cls, batch) -> "VerifyStep | None":
        """For a batch that decodes on the lean step; None otherwise (no speculation then)."""
        return cls(batch.step) if isinstance(batch.step, LeanDecodeStep) else None

    def verify(self, batch, tokens: Sequence[Sequence[int]], positions: Sequence[int]) -> Verified:
        """Feed row r the tokens `tokens[r]` (at least one) from position `positions[r]`. Writes their K/V
        into the rows' free columns; leaves `lengths` and the linear state buffers as they were."""
        lean, dev = self.lean, self.lean.embed.device
        counts = [len(t) for t in tokens]
        if len(counts) != len(batch.keys) or min(counts) < 1:
            raise ValueError("verify needs one or more tokens for every row of the batch")
        batch.reserve(len(counts), max(batch.lengths) + max(counts) + 1)
        lay = _Layout(counts, batch.lengths, dev)
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=dev)
        h = F.embedding(ids, lean.embed)  # [N, hidden]
        cos = sin = None
        if lean.rotary is not None:
            pos = torch.tensor([p + i for p, n in zip(positions, counts) for i in range(n)], dtype=torch.long, device=dev)
            c, s = lean.rotary(h[None], pos[None])
            cos, sin = c[0][:, None, :], s[0][:, None, :]  # [N, 1, rot]
        conv_out: list[torch.Tensor] = []
        states_out: list[list[torch.Tensor]] = []
        # On the lean step's native ops (`LeanDecodeStep.ops`) each residual add runs with the norm after it
        # and every attention layer is one call over the flat tokens (each token its row's length + its
        # place among the new tokens: causal); the linear mixers are the same either way.
        ops, d = lean.ops, None
        if ops is not None:
            lens, rows = (lay.cols_flat + 1).contiguous(), lay.rows.contiguous()
            if cos is not None:
                cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()

        def add_norm(norm, h, d):
            """(h + d, its norm): in place and in one call on the native ops."""
            if ops is not None:
                return h, norm.add_native(ops, h, d)
            h = h if d is None else h + d
            return h, norm(h)

        for norm1, mixer, kind, norm2, mlp in lean.layers:
            h, x = add_norm(norm1, h, d)
            if kind == "attention" and ops is not None:
                q, k, v, gate = mixer.project(x, None, None)
                out = ops.attend(q.contiguous(), k.contiguous(), v.contiguous(), batch._k[mixer.j], batch._v[mixer.j],
                                 lens, mixer.scale, cos, sin, rows=rows)
                y = mixer.output(out, gate)
            elif kind == "attention":
                y = self._attention(mixer, x, batch, lay, cos, sin)
            elif kind == "mamba2":
                y = self._mamba2(mixer, x, batch, lay, conv_out, states_out)
            else:
                y = self._gated_deltanet(mixer, x, batch, lay, conv_out, states_out)
            h, x = add_norm(norm2, h, y)
            d = mlp(x) if ops is None else mlp.native(x, ops)
        _, x = add_norm(lean.final_norm, h, d)
        logits = _mm(x, lean.lm_w, lean.lm_b).float()
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
            width = batch._conv[p].shape[-1]
            starts = index + 1
            picked = torch.stack([conv[r, :, int(starts[r]):int(starts[r]) + width] for r in range(b)])
            batch._conv[p][:b] = picked.to(batch._conv[p].dtype)
            batch._state[p][:b] = states.at(index).to(batch._state[p].dtype)
        batch.lengths = [n + k for n, k in zip(batch.lengths, kept)]
        batch._point(max(batch.lengths))

    # --- layers --------------------------------------------------------------------------------
    @staticmethod
    def _attention(att, x, batch, lay: _Layout, cos, sin) -> torch.Tensor:
        N, H, Hkv, D = x.shape[0], att.H, att.Hkv, att.D
        q, k, v = _mm(x, att.w, att.b).split([att.nq, Hkv * D, Hkv * D], dim=-1)
        gate = None
        if att.gated:
            qg = q.view(N, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(N, H * D)
        q, k, v = q.reshape(N, H, D), k.reshape(N, Hkv, D), v.reshape(N, Hkv, D)
        if att.q_norm is not None:
            q, k = att.q_norm(q), att.k_norm(k)
        if cos is not None:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        kb, vb = batch._k[att.j], batch._v[att.j]
        kb[lay.rows, :, lay.cols_flat] = k
        vb[lay.rows, :, lay.cols_flat] = v
        # Row by row, each over its own live columns as they lie in the buffers: no padding to the longest
        # row or the longest draft (with long contexts that padding cost more than the draft saved), no copy.
        G, outs, at = H // Hkv, [], 0
        for r, (n, L) in enumerate(zip(lay.counts, lay.lengths)):
            W = L + n
            qr = q[at:at + n].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
            scores = torch.matmul(qr, kb[r, :, :W].transpose(-1, -2)) * att.scale  # [Hkv, G*n, W]
            if n > 1:
                scores = scores.view(Hkv, G, n, W)
                scores[..., L:] += lay.causal(n, scores.dtype)
                scores = scores.view(Hkv, G * n, W)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(probs, vb[r, :, :W])  # [Hkv, G*n, D]
            outs.append(o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H * D))
            at += n
        out = torch.cat(outs)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return _mm(out, att.o_w, att.o_b)

    @staticmethod
    def _conv(batch, p: int, lay: _Layout, x: torch.Tensor, weight, bias, conv_out: list) -> torch.Tensor:
        """Depthwise causal conv of the new inputs x [B, T, C] after row p's conv state; silu of it [B, T, C]."""
        state = batch._conv[p][:lay.b]  # [B, C, K]
        K = state.shape[-1]
        seq = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # [B, C, K + T]
        conv_out.append(seq)
        windows = seq.unfold(-1, K, 1)[:, :, 1:]  # [B, C, T, K]: the window ending at each new token
        out = (windows.to(weight.dtype) * weight[:, None, :]).sum(-1)  # [B, C, T]
        if bias is not None:
            out = out + bias[:, None]
        return F.silu(out).transpose(1, 2)

    def _mamba2(self, m, x, batch, lay: _Layout, conv_out: list, states_out: list) -> torch.Tensor:
        """The SSD recurrence over each row's T new tokens in closed form, not token by token: with
        c_t = sum_{s<=t} dt_s a (the log decay), the state after token t is
        S_t = exp(c_t) S_0 + sum_{s<=t} exp(c_t - c_s) dt_s x_s B_s^T, so every output
        y_t = C_t S_t + D x_t is one [T, T] product per head plus S_0's share, and no per-token state
        is formed here: `_SSDStates` forms the one state a row keeps when `commit` asks for it."""
        B, T, H, P, G, N = lay.b, lay.t, m.H, m.P, m.G, m.N
        dtype = x.dtype
        gate, xbc, dt = _mm(x, m.w, m.b).split([m.I, m.C, H], dim=-1)
        xbc = self._conv(batch, m.p, lay, lay.pad(xbc), m.conv_w, m.conv_b, conv_out)  # [B, T, C]
        hs, Bm, Cm = xbc.split([m.I, G * N, G * N], dim=-1)
        dt = F.softplus(lay.pad(dt) + m.dt_bias.to(dt.dtype))  # [B, T, H]
        ssd = _SSDStates(batch._state[m.p][:B], dt, m.A, hs.reshape(B, T, H, P), Bm.reshape(B, T, G, N), H // G)
        Ch = Cm.reshape(B, T, G, N).float().permute(0, 2, 1, 3).repeat_interleave(H // G, dim=1)  # [B, H, T, N]
        Bh = ssd.Bh.permute(0, 2, 1, 3)  # [B, H, T, N]
        decay = (ssd.cum[..., :, None] - ssd.cum[..., None, :]).masked_fill_(~lay.lower(T), float("-inf")).exp_()  # [B, H, t, s]
        mix = torch.matmul(Ch, Bh.transpose(-1, -2)) * decay * ssd.dt[..., None, :]  # [B, H, t, s]: C_t.B_s exp(c_t - c_s) dt_s
        y = torch.matmul(mix, ssd.x)  # [B, H, T, P]
        y = y + torch.matmul(Ch, ssd.S0.float().transpose(-1, -2)) * ssd.cum.exp()[..., None]  # S_0's share: exp(c_t) C_t S_0
        y = y.to(dtype) + hs.reshape(B, T, H, P).permute(0, 2, 1, 3) * m.D[:, None, None]
        states_out.append(ssd)
        y = lay.unpad(y.permute(0, 2, 1, 3)).reshape(-1, H * P).float() * F.silu(gate.float())
        yg = y.view(y.shape[0], G, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + m.norm_eps)
        y = m.norm_w * yg.view(y.shape[0], -1).to(dtype)
        return _mm(y.to(dtype), m.o_w, m.o_b)

    def _gated_deltanet(self, m, x, batch, lay: _Layout, conv_out: list, states_out: list) -> torch.Tensor:
        B, T, Hk, Hv, dk, dv = lay.b, lay.t, m.Hk, m.Hv, m.dk, m.dv
        dtype = x.dtype
        qkv, z, b, a = _mm(x, m.w, m.b).split([m.C, m.value_dim, Hv, Hv], dim=-1)
        qkv = self._conv(batch, m.p, lay, lay.pad(qkv), m.conv_w, m.conv_b, conv_out)  # [B, T, C]
        q, k, v = qkv.float().split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
        if Hk != Hv:
            q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q / (dk ** 0.5)
        beta = lay.pad(b).sigmoid().float()  # [B, T, Hv]
        g = m.neg_A * F.softplus(lay.pad(a).float() + m.dt_bias)  # [B, T, Hv]
        S = batch._state[m.p][:B].float()
        states, outs = [], []
        for t in range(T):
            S = (S * g[:, t].exp()[..., None, None]).float()
            kv_mem = torch.matmul(k[:, t, :, None, :], S)[:, :, 0]  # [B, Hv, dv]
            delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
            S = S + k[:, t, ..., None] * delta[:, :, None, :]
            states.append(S)
            outs.append(torch.matmul(q[:, t, :, None, :], S)[:, :, 0])  # [B, Hv, dv]
        states_out.append(_TokenStates(states))
        o = lay.unpad(torch.stack(outs, dim=1)).to(dtype).float()  # [N, Hv, dv]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps)
        o = (m.norm_w * o.to(dtype)) * F.silu(z.view(-1, Hv, dv).float())
        return _mm(o.to(dtype).reshape(-1, Hv * dv), m.o_w, m.o_b)
