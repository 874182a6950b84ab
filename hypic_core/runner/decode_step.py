"""The lean decode step: one forward of B sequences x 1 token, written for decode instead of the HF module graph.

Per step it does what the module path does per layer or per token once: weights fused at construction
(QKV; gate-up; a Gated DeltaNet layer's qkv/z/b/a), the modules' parameters made views into them (one
copy in memory; the module path, the reference, reads the same numbers); rotary (and on torch's ops
the padding mask) built once and shared by every attention layer; each attention layer writes its
new K/V column straight into the `DecodeBatch` row buffers (`batch.attention_layer(j)`) and attends
over their live columns; each linear layer advances its rows (`batch.linear_layer(p)`) in place with
the closed-form one-token update (conv shifted by one column; Mamba2 S <- exp(dt a) S + dt x B^T;
Gated DeltaNet S <- exp(g)(I - b k k^T) S + b k v^T).

Every op runs through an op table chosen once, at construction (runner/ops.py): `TorchOps`, the
reference, or `NativeOps` (native/decode_matmul.py's kernels). Each mixer family is one class here:
`__call__(x, rows, ops)` for one token a row and, for the linear ones, `verify(...)`: the multi-token
recurrence of speculation's verification forward (runner/verify_step.py, which runs the same layers
and ops on several tokens a row): Mamba2's in closed form (`_SSDStates`), Gated DeltaNet's token by
token (`_TokenStates`); both leave the rows as they were and hand back the state after any token.

Covered (`LeanDecodeStep.build` returns None otherwise, and the batch keeps the module path): dense
llama / qwen3, Gated DeltaNet qwen3_5 (+ MoE) and qwen3_next (its grouped projections reordered into
a copy; sparse MLPs run as their modules), Mamba2 bamba. Not covered: olmo_hybrid (post-norms),
granitemoehybrid, nemotron_h, zamba2, falcon_h1 (Mamba2 with multipliers, shared or parallel blocks),
kimi_linear (KDA + MLA), minimax (lightning). tests/engine/test_decode_step.py holds fp32 logits
within 1e-4 of the module path and greedy tokens identical over joins and leaves.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .ops import Rows, TorchOps, ops_for

_COVERED = ("llama", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "bamba")
_NULL = contextlib.nullcontext()


def uncovered_reason(model: torch.nn.Module) -> str | None:
    """Why the lean step cannot run `model` (None: it can)."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in _COVERED:
        return f"model type {model_type!r} has no lean decode step (covered: {', '.join(_COVERED)})"
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {model.config._attn_implementation!r}"
    return None


class Norm:
    """RMSNorm as the module computes it: w * normed.to(dtype) (llama, bamba, qwen3) or, zero-centred,
    (normed * (1 + w)).to(dtype) (qwen3_5). Which one is read off the module by a numeric probe.
    `native_weight` is the one weight both forms multiply by in fp32 (what the native op takes)."""

    def __init__(self, module: torch.nn.Module):
        self.weight = module.weight.detach()
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        probe = torch.randn(3, self.weight.shape[-1], dtype=self.weight.dtype, device=self.weight.device)
        with torch.no_grad():
            ref = module(probe)
            normed = probe.float() * torch.rsqrt(probe.float().pow(2).mean(-1, keepdim=True) + self.eps)
            self.centred = not torch.allclose(ref.float(), (self.weight * normed.to(probe.dtype)).float(), atol=1e-5)
        self.native_weight = self.weight
        if self.centred:
            self.native_weight = self.one_plus = 1.0 + self.weight.float()
            if not torch.allclose(ref.float(), (normed * self.one_plus).to(probe.dtype).float(), atol=1e-5):
                raise ValueError(f"{type(module).__name__}: not an RMSNorm the lean step knows")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.one_plus).to(x.dtype) if self.centred else self.weight * h.to(x.dtype)


class Attention:
    """Full attention (llama / qwen3 / qwen3_5 gated / bamba) on the batch's K/V row buffers."""

    def __init__(self, attn: torch.nn.Module, j: int, config, ops: TorchOps):
        self.j = j
        self.D = int(attn.head_dim)
        self.H = int(config.num_attention_heads)
        self.Hkv = int(config.num_key_value_heads)
        self.gated = attn.q_proj.out_features == 2 * self.H * self.D
        self.nq = attn.q_proj.out_features
        self.qkv = ops.linear_weight([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_norm = Norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = Norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.plain = not self.gated and self.q_norm is None  # q | k | v, attention, o: what a native block runs
        self.scale = float(attn.scaling)
        self.o = ops.linear_weight([attn.o_proj])

    def __call__(self, x: torch.Tensor, rows: Rows, ops: TorchOps) -> torch.Tensor:
        """x [N, hidden] of the tokens `rows` describes: their K/V written into the batch, the attention
        output projected [N, hidden]."""
        N, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        q, k, v = ops.linear(x, self.qkv).split([self.nq, Hkv * D, Hkv * D], dim=-1)
        gate = None
        if self.gated:  # per head [query | gate]
            qg = q.view(N, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(N, H * D)
        q, k, v = q.reshape(N, H, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ops.attend(q, k, v, rows.batch.attention_layer(self.j), rows, self.scale)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return ops.linear(out, self.o)

    def block(self, h: torch.Tensor, d: torch.Tensor | None, norm: Norm, rows: Rows, ops: TorchOps) -> torch.Tensor:
        """The layer from the residual stream: h += d, then this on norm(h)."""
        return ops.attention_block(h, d, norm, self, rows)


def causal_conv(conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Depthwise causal conv of new inputs x [B, T, C] after the conv rows `conv` [B, C, K] (not changed):
    (silu of it [B, T, C], the old state then the new inputs [B, C, K + T]: the state after token t is
    its K columns ending at K + t)."""
    K = conv.shape[-1]
    seq = torch.cat([conv, x.transpose(1, 2).to(conv.dtype)], dim=-1)
    out = (seq.unfold(-1, K, 1)[:, :, 1:].to(weight.dtype) * weight[:, None, :]).sum(-1)  # [B, C, T]
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out).transpose(1, 2), seq


def conv_step(conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token a row, x [B, C]: `causal_conv` with the conv rows advanced in place; [B, C]."""
    out, seq = causal_conv(conv, x[:, None], weight, bias)
    conv.copy_(seq[..., 1:])
    return out[:, 0]


def _linear_mixer_parts(mixer, m: torch.nn.Module, ops: TorchOps) -> None:
    """What a Mamba2 and a Gated DeltaNet mixer both read off their module: the depthwise conv (weight
    [C, K], bias), dt_bias, the gated norm's weight and eps, and out_proj."""
    mixer.conv_w, mixer.conv_b = m.conv1d.weight.detach()[:, 0], None if m.conv1d.bias is None else m.conv1d.bias.detach()
    mixer.dt_bias = m.dt_bias.detach()
    mixer.norm_w, mixer.norm_eps = m.norm.weight.detach(), float(m.norm.variance_epsilon)
    mixer.out_proj = ops.linear_weight([m.out_proj])


class Mamba2:
    """Bamba's Mamba2 mixer, one token: S <- exp(dt a) S + dt x B^T, y = S C + D x, gated group RMSNorm."""

    def __init__(self, m: torch.nn.Module, p: int, ops: TorchOps):
        self.p = p
        self.in_proj = ops.linear_weight([m.in_proj])
        self.I, self.C, self.H, self.P = int(m.intermediate_size), int(m.conv_dim), int(m.num_heads), int(m.head_dim)
        self.G, self.N = int(m.n_groups), int(m.ssm_state_size)
        self.A, self.D = -torch.exp(m.A_log.detach().float()), m.D.detach()
        _linear_mixer_parts(self, m, ops)

    def __call__(self, x: torch.Tensor, rows: Rows, ops: TorchOps) -> torch.Tensor:
        conv, state = rows.batch.linear_layer(self.p)
        return ops.linear(ops.mamba2(self, ops.linear(x, self.in_proj), conv, state), self.out_proj)

    def block(self, h: torch.Tensor, d: torch.Tensor | None, norm: Norm, rows: Rows, ops: TorchOps) -> torch.Tensor:
        """The layer from the residual stream, one token per row: h += d, then this on norm(h)."""
        conv, state = rows.batch.linear_layer(self.p)
        return ops.mamba2_block(h, d, norm, self, conv, state)

    def gated_norm(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """norm_w * group_rmsnorm(y * silu(gate)) for y, gate [N, H * P]."""
        y = y.float() * F.silu(gate.float())
        yg = y.view(y.shape[0], self.G, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.norm_w * yg.view(y.shape[0], -1).to(dtype)).to(dtype)

    def between(self, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The mixer between in_proj and out_proj, one token per row (zx [B, gate | xBC | dt]), with this
        layer's conv and state rows [B, ...] advanced in place: `TorchOps.mamba2`."""
        B, H, P, G, N = zx.shape[0], self.H, self.P, self.G, self.N
        dtype = zx.dtype
        gate, xbc, dt = zx.split([self.I, self.C, H], dim=-1)
        xbc = conv_step(conv, xbc, self.conv_w, self.conv_b)
        hs, Bm, Cm = xbc.split([self.I, G * N, G * N], dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))  # [B, H] (the module's decode path clamps nothing)
        dA = torch.exp(dt.float() * self.A)  # [B, H]
        hs = hs.view(B, H, P)
        Bh = Bm.view(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, 1, N)
        Ch = Cm.view(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, N, 1)
        dBx = (dt[..., None, None] * Bh) * hs[..., None]  # [B, H, P, N]
        if state.dtype == torch.float32:
            state.mul_(dA[..., None, None]).add_(dBx)
            new = state
        else:
            new = state.float() * dA[..., None, None] + dBx
            state.copy_(new)
        y = torch.matmul(new.to(Ch.dtype), Ch)[..., 0] + hs * self.D[:, None]  # [B, H, P]
        return self.gated_norm(y.reshape(B, H * P), gate, dtype)

    def verify(self, x: torch.Tensor, rows: Rows, ops: TorchOps, lay, conv_out: list, states_out: list) -> torch.Tensor:
        """Several tokens a row (x flat [N, hidden]; `lay` the padded [B, T] layout, verify_step._Layout),
        the rows left as they were: the conv inputs appended to conv_out, an `_SSDStates` to states_out.
        The SSD recurrence in closed form, not token by token: with c_t = sum_{s<=t} dt_s a (the log
        decay), S_t = exp(c_t) S_0 + sum_{s<=t} exp(c_t - c_s) dt_s x_s B_s^T, so every output
        y_t = C_t S_t + D x_t is one [T, T] product per head plus S_0's share, and no per-token state
        is formed here: `_SSDStates` forms the one state a row keeps when `commit` asks for it."""
        B, T, H, P, G, N = lay.b, lay.t, self.H, self.P, self.G, self.N
        dtype = x.dtype
        conv, state = rows.batch.linear_layer(self.p)
        if ops.stepped_verify:
            return self._verify_stepped(x, conv, state, ops, lay, conv_out, states_out)
        gate, xbc, dt = ops.linear(x, self.in_proj).split([self.I, self.C, H], dim=-1)
        xbc, seq = causal_conv(conv, lay.pad(xbc), self.conv_w, self.conv_b)  # [B, T, C]
        conv_out.append(seq)
        hs, Bm, Cm = xbc.split([self.I, G * N, G * N], dim=-1)
        dt = F.softplus(lay.pad(dt) + self.dt_bias.to(dt.dtype))  # [B, T, H]
        ssd = _SSDStates(state, dt, self.A, hs.reshape(B, T, H, P), Bm.reshape(B, T, G, N), H // G)
        Ch = Cm.reshape(B, T, G, N).float().permute(0, 2, 1, 3).repeat_interleave(H // G, dim=1)  # [B, H, T, N]
        Bh = ssd.Bh.permute(0, 2, 1, 3)  # [B, H, T, N]
        decay = (ssd.cum[..., :, None] - ssd.cum[..., None, :]).masked_fill_(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril_(), float("-inf")).exp_()  # [B, H, t, s]
        mix = torch.matmul(Ch, Bh.transpose(-1, -2)) * decay * ssd.dt[..., None, :]  # [B, H, t, s]: C_t.B_s exp(c_t - c_s) dt_s
        y = torch.matmul(mix, ssd.x)  # [B, H, T, P]
        y = y + torch.matmul(Ch, ssd.S0.float().transpose(-1, -2)) * ssd.cum.exp()[..., None]  # S_0's share: exp(c_t) C_t S_0
        y = y.to(dtype) + hs.reshape(B, T, H, P).permute(0, 2, 1, 3) * self.D[:, None, None]
        states_out.append(ssd)
        y = self.gated_norm(lay.unpad(y.permute(0, 2, 1, 3)).reshape(-1, H * P), gate, dtype)
        return ops.linear(y, self.out_proj)

    def _verify_stepped(self, x, conv, state, ops: TorchOps, lay, conv_out: list, states_out: list) -> torch.Tensor:
        """`verify` token by token on the op table's one-token update (`ops.mamba2`, one native call for
        every row at once), on copies of the rows' conv and state: what plain decoding computes, in the
        same order, where the closed form costs ~20 small torch ops a layer (the ops that made a
        verification forward on an AVX2 CPU cost as much as two plain steps, docs/benchmarks.md). A row
        shorter than the longest steps on through zero padding; no output or state of it past its own
        tokens is read."""
        zx = lay.pad(ops.linear(x, self.in_proj))  # [B, T, gate | xBC | dt]
        xbc = zx[..., self.I:self.I + self.C]
        conv_out.append(torch.cat([conv, xbc.transpose(1, 2).to(conv.dtype)], dim=-1))  # [B, C, K + T]
        c, st = conv.clone(), state.clone()
        ys, kept = [], []
        for t in range(lay.t):
            ys.append(ops.mamba2(self, zx[:, t].contiguous(), c, st))
            kept.append(st.clone())
        states_out.append(_TokenStates(kept))
        return ops.linear(lay.unpad(torch.stack(ys, dim=1)), self.out_proj)


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


class GatedDeltaNet:
    """qwen3_5's Gated DeltaNet mixer, one token: S <- exp(g) S; S <- S + k (b (v - S^T k))^T; o = S^T q."""

    def __init__(self, m: torch.nn.Module, p: int, ops: TorchOps):
        self.p = p
        parts = _grouped_projections(m) if hasattr(m, "in_proj_qkvz") else [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
        self.in_proj = ops.linear_weight(parts)
        self.Hk, self.Hv, self.dk, self.dv = int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim)
        self.key_dim, self.value_dim, self.C = int(m.key_dim), int(m.value_dim), int(m.conv_dim)
        self.neg_A = -m.A_log.detach().float().exp()
        _linear_mixer_parts(self, m, ops)

    def __call__(self, x: torch.Tensor, rows: Rows, ops: TorchOps) -> torch.Tensor:
        conv, state = rows.batch.linear_layer(self.p)
        qkv, z, b, a = ops.linear(x, self.in_proj).split([self.C, self.value_dim, self.Hv, self.Hv], dim=-1)
        q, k, v, beta, g = (t[:, 0] for t in self.heads(conv_step(conv, qkv, self.conv_w, self.conv_b)[:, None], b, a))
        S, out = self.delta(state.float(), q, k, v, beta, g)
        state.copy_(S)
        return self.output(out, z, ops)

    def block(self, h: torch.Tensor, d: torch.Tensor | None, norm: Norm, rows: Rows, ops: TorchOps) -> torch.Tensor:
        """The layer from the residual stream, one token per row: h += d, then this on norm(h)."""
        return self(ops.add_rmsnorm(h, d, norm), rows, ops)

    @staticmethod
    def delta(S: torch.Tensor, q, k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of the gated delta rule on S [B, Hv, dk, dv] (fp32; a new S is returned) and its
        output S^T q [B, Hv, dv], for q, k [B, Hv, dk], v [B, Hv, dv], beta and g [B, Hv]."""
        S = (S * g.exp()[..., None, None]).float()
        delta = (v - torch.matmul(k[:, :, None, :], S)[:, :, 0]) * beta[..., None]
        S = S + k[..., None] * delta[:, :, None, :]
        return S, torch.matmul(q[:, :, None, :], S)[:, :, 0]

    def heads(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """The conv's output qkv [B, T, C] and the b, a projections ([B, T, Hv] or flat [B, Hv]) as the
        recurrence reads them: q, k [B, T, Hv, dk] (l2-normed, q scaled), v [B, T, Hv, dv], beta and the
        log decay g [B, T, Hv] (fp32)."""
        B, T = qkv.shape[:2]
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(B, T, self.Hk, self.dk), k.reshape(B, T, self.Hk, self.dk), v.reshape(B, T, self.Hv, self.dv)
        if self.Hk != self.Hv:
            q, k = q.repeat_interleave(self.Hv // self.Hk, dim=2), k.repeat_interleave(self.Hv // self.Hk, dim=2)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = b.sigmoid().float().reshape(B, T, self.Hv)
        g = (self.neg_A * F.softplus(a.float() + self.dt_bias)).reshape(B, T, self.Hv)
        return q / (self.dk ** 0.5), k, v, beta, g

    def output(self, out: torch.Tensor, z: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """The gated RMSNorm of the recurrence's output out [N, Hv, dv] and out_proj: [N, hidden]."""
        dtype = z.dtype
        o = out.to(dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        o = (self.norm_w * o.to(dtype)) * F.silu(z.view(-1, self.Hv, self.dv).float())
        return ops.linear(o.to(dtype).reshape(-1, self.Hv * self.dv), self.out_proj)

    def verify(self, x: torch.Tensor, rows: Rows, ops: TorchOps, lay, conv_out: list, states_out: list) -> torch.Tensor:
        """`Mamba2.verify`'s contract; the delta rule stepped token by token over the padded [B, T]
        layout, every state kept (`_TokenStates`)."""
        conv, state = rows.batch.linear_layer(self.p)
        qkv, z, b, a = ops.linear(x, self.in_proj).split([self.C, self.value_dim, self.Hv, self.Hv], dim=-1)
        qkv, seq = causal_conv(conv, lay.pad(qkv), self.conv_w, self.conv_b)  # [B, T, C]
        conv_out.append(seq)
        q, k, v, beta, g = self.heads(qkv, lay.pad(b), lay.pad(a))
        S = state.float()
        states, outs = [], []
        for t in range(lay.t):
            S, out = self.delta(S, q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t])
            states.append(S)
            outs.append(out)
        states_out.append(_TokenStates(states))
        return self.output(lay.unpad(torch.stack(outs, dim=1)), z, ops)


class _TokenStates:
    """A recurrence stepped token by token: every state kept, `at` picks one per row."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states  # T states [B, ...]: the state after each token

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """Row r's state after its token index[r]: [B, ...]."""
        return torch.stack(self.states)[index, torch.arange(index.shape[0])]


def _grouped_projections(m: torch.nn.Module) -> list[torch.nn.Linear]:
    """qwen3_next's in_proj_qkvz / in_proj_ba (rows grouped per key head: [q k v z], [b a]) as four
    linears in qwen3_5's order (qkv, z, b, a). They are copies: the fused weight made from them is
    this layer's second copy, the modules keep theirs."""
    hk, hv, dk, dv = int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim)
    r = hv // hk
    w = m.in_proj_qkvz.weight.detach()
    q, k, v, z = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = m.in_proj_ba.weight.detach().view(hk, 2 * r, -1).split([r, r], dim=1)
    out = []
    for rows in (torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)]),
                 z.reshape(hv * dv, -1), b.reshape(hv, -1), a.reshape(hv, -1)):
        lin = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        lin.weight.data = rows.contiguous()
        out.append(lin)
    return out


class MLP:
    """silu(gate) * up, down, with gate and up fused; any other MLP (MoE) runs as its module."""

    def __init__(self, mlp: torch.nn.Module, ops: TorchOps):
        self.module = None
        act = getattr(mlp, "act_fn", None)
        probe = torch.randn(8)
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) and act is not None \
                and torch.allclose(act(probe), F.silu(probe)):
            self.gate_up = ops.linear_weight([mlp.gate_proj, mlp.up_proj])
            self.down = ops.linear_weight([mlp.down_proj])
        else:
            self.module = mlp

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        if self.module is not None:
            return self.module(x[:, None])[:, 0]
        return ops.linear(ops.silu_mul(ops.linear(x, self.gate_up)), self.down)

    def block(self, h: torch.Tensor, d: torch.Tensor | None, norm: Norm, ops: TorchOps) -> torch.Tensor:
        """From the residual stream: h += d, then the MLP on norm(h)."""
        if self.module is not None:
            return self(ops.add_rmsnorm(h, d, norm), ops)
        return ops.mlp_block(h, d, norm, self)


class LeanDecodeStep:
    """`step(batch, token_ids, positions) -> logits [B, vocab] (fp32)`: one decode forward on a
    `DecodeBatch`'s rows (the batch has reserved room for the new column; it advances `lengths`).

    `ops`: the op table (runner/ops.py), fixed at construction; `kernel` names it. `ranges = True`
    wraps each part in a torch.profiler `record_function` (bench/decode.py splits the step by layer
    kind with it)."""

    def __init__(self, model: torch.nn.Module, adapter, ops: TorchOps | None = None):
        self.ops = ops = ops if ops is not None else TorchOps()
        base = model.base_model
        self.model = model
        self.rotary = getattr(base, "rotary_emb", None)
        self.final_norm = Norm(getattr(base, "norm", None) or base.final_layernorm)
        self.lm_head = ops.linear_weight([model.get_output_embeddings()])  # a tied embedding table becomes a view too
        self.embed = base.embed_tokens.weight.detach()  # read after: a tied table is now that view
        attn_j = {i: j for j, i in enumerate(adapter.attention_layers)}
        lin_p = {i: p for p, i in enumerate(adapter.linear_layers)}
        self.layers = []
        for i, layer in enumerate(base.layers[: adapter.num_layers]):
            norm2 = getattr(layer, "post_attention_layernorm", None) or layer.pre_ff_layernorm
            if getattr(layer, "self_attn", None) is not None and i in attn_j:
                mixer, kind = Attention(layer.self_attn, attn_j[i], model.config, ops), "attention"
            elif getattr(layer, "mamba", None) is not None:
                mixer, kind = Mamba2(layer.mamba, lin_p[i], ops), "mamba2"
            elif getattr(layer, "linear_attn", None) is not None:
                mixer, kind = GatedDeltaNet(layer.linear_attn, lin_p[i], ops), "gated_deltanet"
            else:
                raise ValueError(f"layer {i} ({type(layer).__name__}): no mixer the lean step knows")
            mlp = getattr(layer, "mlp", None) or layer.feed_forward
            self.layers.append((Norm(layer.input_layernorm), mixer, kind, Norm(norm2), MLP(mlp, ops)))
        self.ranges = False

    @property
    def kernel(self) -> str:
        """The decode kernel the step runs (EngineConfig.decode_kernel's name of its op table)."""
        return self.ops.name

    @classmethod
    def build(cls, model: torch.nn.Module, adapter, kernel: str = "torch") -> "LeanDecodeStep | None":
        """The step for `model` on the op table of decode kernel `kernel` (ops.ops_for: "torch", "native",
        "native-f16", "native-i8", "native-q8"; a native one where it cannot run keeps "torch" and logs why), or None
        when its family is not covered (`uncovered_reason`)."""
        return None if uncovered_reason(model) else cls(model, adapter, ops_for(kernel, model))

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.ranges else _NULL

    def __call__(self, batch, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        return self.forward(batch, [[t] for t in token_ids], positions)

    def forward(self, batch, tokens: Sequence[Sequence[int]], positions: Sequence[int],
                linear: Callable | None = None) -> torch.Tensor:
        """Row r of `batch` fed `tokens[r]` from position `positions[r]`, K/V written at its columns
        lengths[r].. (lengths not advanced); logits after each token, flat [N, vocab] fp32. `linear(mixer,
        x, rows)`, when given, runs the linear mixers instead of their one-token update (the verification
        forward's: their `verify`, runner/verify_step.py)."""
        ops, dev = self.ops, self.embed.device
        counts = [len(t) for t in tokens]
        with self._range("embed+rope"):
            h = F.embedding(torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=dev), self.embed)
            cos = sin = None
            if self.rotary is not None:
                pos = torch.tensor([p + i for p, n in zip(positions, counts) for i in range(n)], dtype=torch.long, device=dev)
                c, s = self.rotary(h[None], pos[None])
                cos, sin = c[0], s[0]  # [N, rot]
            rows = ops.prepare(Rows(batch, counts, cos, sin))
        d = None
        for norm1, mixer, kind, norm2, mlp in self.layers:
            with self._range(kind):
                if linear is None or kind == "attention":
                    d = mixer.block(h, d, norm1, rows, ops)
                else:
                    d = linear(mixer, ops.add_rmsnorm(h, d, norm1), rows)
            with self._range("mlp"):
                d = mlp.block(h, d, norm2, ops)
        with self._range("lm_head"):
            return ops.norm_linear(h, d, self.final_norm, self.lm_head).float()
