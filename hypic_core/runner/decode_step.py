"""The lean decode step: one forward of B sequences x 1 token, written for decode instead of the HF module graph.

What it does per step that the module path does per layer or per token:
- weights fused once at construction (QKV; gate-up; a Gated DeltaNet layer's qkv/z/b/a projections),
  the modules' own parameters made views into the fused ones, so memory is not doubled and the
  module path (the reference) reads the same numbers;
- rotary cos/sin and the padding mask (an additive bias [B, 1, 1, W], none when every row has the
  same length) built once per step and shared by every attention layer;
- each attention layer writes its new key/value column straight into the `DecodeBatch` row
  buffers and attends over their live columns with grouped matmuls (no repeat of K/V, no cache
  object, no mask builder);
- every linear layer advances its row buffers in place with the closed-form one-token update:
  conv state shifted by one column and the depthwise conv as one multiply-sum; Mamba2
  S <- exp(dt a) S + dt x B^T; Gated DeltaNet S <- exp(g)(I - b k k^T) S + b k v^T.

Families it covers (`LeanDecodeStep.build` returns None with the reason otherwise, and the batch
keeps the module path): dense llama / qwen3, Gated DeltaNet qwen3_5 (+ its MoE variant) and
qwen3_next (its grouped projections reordered into a copy; sparse MLPs run as their modules), Mamba2
bamba. Not covered: olmo_hybrid (post-norms), granitemoehybrid, nemotron_h, zamba2, falcon_h1
(Mamba2 with multipliers, shared or parallel blocks), kimi_linear (KDA + MLA), minimax (lightning).

The matmuls run torch's kernels (`kernel="torch"`: mm on the transposed weights, or oneDNN's packed copy
with `packed`) or the native AVX2 kernels of runner/decode_matmul.py (`kernel="native"`: the fp32
weights kept [out, in], streamed at close to the machine's bandwidth from one to eight rows;
"native-f16": an fp16 copy of them, half the bytes, lossy; "native-i8": a per-row int8 copy, a quarter
of the bytes, lossier). With a native kernel on an fp32 model the
rest of the step runs native too (`_native`): each residual add with the norm after it, the MLP's
silu(gate) * up, an attention layer's rotary + K/V write + attention over each row's own columns
(flash-decoding blocks; no mask), and a Mamba2 mixer's conv shift, state update and gated group norm,
one call each; the torch code stays as their reference (tests/engine/test_decode_ops.py).
docs/benchmarks.md measures each.

`LeanDecodeStep.compile` runs the same step as a few `torch.compile`d blocks (inductor); measured
in bench/decode.py `--compile`, it bought too little on this CPU for the gateway to compile
(docs/benchmarks.md), so nothing serves it by default.

The module path (`DecodeBatch.forward` without a step) stays the reference:
tests/engine/test_decode_step.py holds fp32 logits within 1e-4 and greedy tokens identical step for
step over joins and leaves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from ..config import DECODE_KERNELS

log = logging.getLogger("hypic.decode_step")
KERNELS = DECODE_KERNELS  # the matmul kernel a step runs (LeanDecodeStep.build)
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


def _fuse(linears: Sequence[torch.nn.Linear], transposed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight, stored transposed [in, sum of outs] (and one bias), for several linears on the same
    input; each module's parameters become views of it (same numbers, one copy in memory).

    Transposed because x @ W with W [in, out] contiguous ran 1.5-2x faster than x @ W^T on [out, in]
    for 1-2 rows with this torch's MKL on this CPU (AMD EPYC, AVX2; docs/benchmarks.md). The modules'
    linears on their now transposed views compute the same product from the same bytes (prefill at
    512 rows: measured unchanged). `transposed=False` keeps it [sum of outs, in], each module's weight
    a block of its rows (the modules' own layout): what the native kernels stream."""
    weight = torch.cat([m.weight.detach() for m in linears])
    weight = weight.t().contiguous() if transposed else weight.contiguous()
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in linears])
    at = 0
    for m in linears:
        n = m.out_features
        m.weight.data = weight[:, at:at + n].t() if transposed else weight[at:at + n]
        if m.bias is not None:
            m.bias.data = bias[at:at + n]
        at += n
    return weight, bias


class _Packed:
    """A weight twice: `plain`, transposed [in, out] (the modules' own, as `_fuse` leaves it), for one
    row, and `packed`, oneDNN's packed layout (opaque, a second copy), for two rows or more."""

    __slots__ = ("plain", "packed")

    def __init__(self, plain: torch.Tensor, packed: torch.Tensor):
        self.plain, self.packed = plain, packed


def _fuse_packed(linears: Sequence[torch.nn.Linear]) -> tuple[_Packed, torch.Tensor | None]:
    """As `_fuse`, plus a copy packed for oneDNN's fp32 linear (for 8 rows): in bench/decode_kernels.py
    on this AVX2 CPU it ran 2-8 rows 1.3-2.5x faster than either plain layout, one row slower than
    [in, out]."""
    plain, bias = _fuse(linears)
    return _Packed(plain, torch.ops.mkldnn._reorder_linear_weight(plain.t().contiguous(), 8)), bias


class _Native:
    """A weight for the native kernels (runner/decode_matmul.py): `w` [out, in] contiguous, fp32 (the
    modules' own rows, as `_fuse(transposed=False)` leaves them), fp16 (a second copy, half the bytes) or
    int8 with its rows' fp32 `scales` (a second copy, a quarter of the bytes)."""

    __slots__ = ("w", "kernel", "scales")

    def __init__(self, w: torch.Tensor, kernel, scales: torch.Tensor | None = None):
        self.w, self.kernel, self.scales = w, kernel, scales


# Rows up to which an fp32 `_Native` weight runs the native kernel; more rows (a verification forward of
# several rows' drafts) run torch's GEMM on the same [out, in] weight, which is faster there.
NATIVE_ROWS = 16


def _fuse_native(kernel, precision: str = "f32"):
    """A `fuse` for the native kernels: fp32 on the modules' own [out, in] rows ("f32"), or on an fp16
    ("f16") or per-row int8 ("i8") copy of them."""
    from .decode_matmul import quantize_int8

    def fuse(linears: Sequence[torch.nn.Linear]) -> tuple[_Native, torch.Tensor | None]:
        weight, bias = _fuse(linears, transposed=False)
        if precision == "i8":
            q, scales = quantize_int8(weight)
            return _Native(q, kernel, scales), bias
        return _Native(weight.half() if precision == "f16" else weight, kernel), bias
    return fuse


def _mm(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [B, in] @ weight [in, out] (+ bias); a `_Packed` weight: oneDNN's packed linear from two rows on;
    a `_Native` one [out, in]: the native kernel (fp32 past NATIVE_ROWS rows: torch's GEMM)."""
    if isinstance(weight, _Native):
        if weight.w.dtype == torch.float32 and x.shape[0] > NATIVE_ROWS:
            return F.linear(x, weight.w, bias)
        return weight.kernel.linear(x.contiguous(), weight.w, bias, weight.scales)
    if isinstance(weight, _Packed):
        if x.shape[0] > 1:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.packed, bias, "none", [], "")
        weight = weight.plain
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


class _Norm:
    """RMSNorm as the module computes it: w * normed.to(dtype) (llama, bamba, qwen3) or, zero-centred,
    (normed * (1 + w)).to(dtype) (qwen3_5). Which one is read off the module by a numeric probe."""

    def __init__(self, module: torch.nn.Module):
        self.weight = module.weight.detach()
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        probe = torch.randn(3, self.weight.shape[-1], dtype=self.weight.dtype, device=self.weight.device)
        with torch.no_grad():
            ref = module(probe)
            normed = probe.float() * torch.rsqrt(probe.float().pow(2).mean(-1, keepdim=True) + self.eps)
            self.centred = not torch.allclose(ref.float(), (self.weight * normed.to(probe.dtype)).float(), atol=1e-5)
        if self.centred:
            self.one_plus = 1.0 + self.weight.float()
            if not torch.allclose(ref.float(), (normed * self.one_plus).to(probe.dtype).float(), atol=1e-5):
                raise ValueError(f"{type(module).__name__}: not an RMSNorm the lean step knows")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.one_plus).to(x.dtype) if self.centred else self.weight * h.to(x.dtype)

    def add_native(self, ops, h: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
        """h += d in place (fp32 rows), then this norm of h, in one native call."""
        return ops.add_rmsnorm(h, d, self.one_plus if self.centred else self.weight, self.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, N, D] on its first cos.shape[-1] dims; cos/sin [B, 1, rot]."""
    rot = cos.shape[-1]
    r = x[..., :rot]
    half = rot // 2
    out = r * cos + torch.cat([-r[..., half:], r[..., :half]], dim=-1) * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


class _Step:
    """What a step shares across layers: rows, the column each row writes, the read width, rotary, mask."""

    __slots__ = ("b", "cols", "rows", "same", "width", "cos", "sin", "bias")


class _Attention:
    """Full attention (llama / qwen3 / qwen3_5 gated / bamba) on the batch's K/V row buffers."""

    def __init__(self, attn: torch.nn.Module, j: int, config, fuse=_fuse):
        self.j = j
        self.D = int(attn.head_dim)
        self.H = int(config.num_attention_heads)
        self.Hkv = int(config.num_key_value_heads)
        self.gated = attn.q_proj.out_features == 2 * self.H * self.D
        self.nq = attn.q_proj.out_features
        self.w, self.b = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_norm = _Norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = _Norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.scale = float(attn.scaling)
        self.o_w, self.o_b = fuse([attn.o_proj])

    def project(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """q [B, H, D], k and v [B, Hkv, D] (normed, rotated) and the output gate (None unless gated)."""
        B, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        q, k, v = _mm(x, self.w, self.b).split([self.nq, Hkv * D, Hkv * D], dim=-1)
        gate = None
        if self.gated:  # per head [query | gate]
            qg = q.view(B, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(B, H * D)
        q, k, v = q.reshape(B, H, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return q, k, v, gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, s: _Step) -> torch.Tensor:
        """Write k, v into the batch's row buffers at each row's column; attention over the live columns [B, H * D]."""
        B, H, Hkv, D = s.b, self.H, self.Hkv, self.D
        kb, vb = batch._k[self.j], batch._v[self.j]
        if s.same is not None:
            kb[:B, :, s.same] = k
            vb[:B, :, s.same] = v
        else:
            kb[s.rows, :, s.cols] = k
            vb[s.rows, :, s.cols] = v
        keys, values = kb[:B, :, :s.width], vb[:B, :, :s.width]
        scores = torch.matmul(q.view(B, Hkv, H // Hkv, D), keys.transpose(-1, -2)) * self.scale  # [B, Hkv, G, W]
        if s.bias is not None:
            scores = scores + s.bias
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values).reshape(B, H * D)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return _mm(out, self.o_w, self.o_b)

    def __call__(self, x: torch.Tensor, batch, s: _Step) -> torch.Tensor:
        q, k, v, gate = self.project(x, s.cos, s.sin)
        return self.output(self.attend(q, k, v, batch, s), gate)

    def native(self, x: torch.Tensor, batch, s: _Step, ops, lens: torch.Tensor) -> torch.Tensor:
        """As `__call__`, the rotary, the K/V write and the attention in one native call (each row to its
        own length: no mask). `s.cos` / `s.sin` are [B, rot] here."""
        q, k, v, gate = self.project(x, None, None)
        out = ops.attend(q.contiguous(), k.contiguous(), v.contiguous(), batch._k[self.j], batch._v[self.j], lens,
                         self.scale, s.cos, s.sin)
        return self.output(out, gate)


def _conv_step(conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Shift x [B, C] into the conv state rows `conv` [B, C, K] (in place); return silu(depthwise conv) [B, C]."""
    window = torch.cat([conv[:, :, 1:], x[:, :, None].to(conv.dtype)], dim=-1)
    conv.copy_(window)
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out)


class _Recurrent:
    """A linear mixer whose rows in the batch are a conv window [C, width] and a recurrent state
    (`state_dims`, fp32), in layer `p`'s slots; `core` advances them in place."""

    def __call__(self, x: torch.Tensor, batch, s: _Step) -> torch.Tensor:
        return self.core(x, batch._conv[self.p][:s.b], batch._state[self.p][:s.b])

    def native(self, x: torch.Tensor, batch, s: _Step, ops, lens: torch.Tensor) -> torch.Tensor:
        """The mixer with its native ops where it has them (this base: none, `__call__`)."""
        return self(x, batch, s)

    def dummy_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv and state rows of `b` sequences, shaped and typed as a batch keeps them (fp32 state)."""
        w = self.conv_w
        return w.new_zeros(b, self.C, w.shape[-1]), w.new_zeros(b, *self.state_dims, dtype=torch.float32)


class _Mamba2(_Recurrent):
    """Bamba's Mamba2 mixer, one token: S <- exp(dt a) S + dt x B^T, y = S C + D x, gated group RMSNorm."""

    def __init__(self, m: torch.nn.Module, p: int, fuse=_fuse):
        self.p = p
        self.w, self.b = fuse([m.in_proj])
        self.I, self.C, self.H, self.P = int(m.intermediate_size), int(m.conv_dim), int(m.num_heads), int(m.head_dim)
        self.G, self.N = int(m.n_groups), int(m.ssm_state_size)
        self.conv_w = m.conv1d.weight.detach()[:, 0]  # [C, K]
        self.conv_b = m.conv1d.bias
        self.A = -torch.exp(m.A_log.detach().float())
        self.dt_bias, self.D = m.dt_bias.detach(), m.D.detach()
        self.norm_w, self.norm_eps = m.norm.weight.detach(), float(m.norm.variance_epsilon)
        self.o_w, self.o_b = fuse([m.out_proj])

    @property
    def state_dims(self) -> tuple[int, int, int]:
        return self.H, self.P, self.N

    def core(self, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The mixer on x [B, hidden] with this layer's conv and state rows [B, ...] (advanced in place)."""
        B, H, P, G, N = x.shape[0], self.H, self.P, self.G, self.N
        dtype = x.dtype
        gate, xbc, dt = _mm(x, self.w, self.b).split([self.I, self.C, H], dim=-1)
        xbc = _conv_step(conv, xbc, self.conv_w, self.conv_b)
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
        y = y.reshape(B, H * P).float() * F.silu(gate.float())
        yg = y.view(B, G, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        y = self.norm_w * yg.view(B, -1).to(dtype)
        return _mm(y.to(dtype), self.o_w, self.o_b)

    def native(self, x: torch.Tensor, batch, s: _Step, ops, lens: torch.Tensor) -> torch.Tensor:
        """As `core`, everything between in_proj and out_proj in one native call."""
        y = ops.mamba2(_mm(x, self.w, self.b), batch._conv[self.p][:s.b], self.conv_w, self.conv_b, self.dt_bias,
                       self.A, self.D, batch._state[self.p][:s.b], self.norm_w, self.norm_eps, self.H, self.P, self.G,
                       self.N)
        return _mm(y, self.o_w, self.o_b)


class _GatedDeltaNet(_Recurrent):
    """qwen3_5's Gated DeltaNet mixer, one token: S <- exp(g) S; S <- S + k (b (v - S^T k))^T; o = S^T q."""

    def __init__(self, m: torch.nn.Module, p: int, fuse=_fuse):
        self.p = p
        parts = _grouped_projections(m) if hasattr(m, "in_proj_qkvz") else [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
        self.w, self.b = fuse(parts)
        self.Hk, self.Hv, self.dk, self.dv = int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim)
        self.key_dim, self.value_dim, self.C = int(m.key_dim), int(m.value_dim), int(m.conv_dim)
        self.conv_w = m.conv1d.weight.detach()[:, 0]
        self.conv_b = m.conv1d.bias
        self.neg_A = -m.A_log.detach().float().exp()
        self.dt_bias = m.dt_bias.detach()
        self.norm_w, self.norm_eps = m.norm.weight.detach(), float(m.norm.variance_epsilon)
        self.o_w, self.o_b = fuse([m.out_proj])

    @property
    def state_dims(self) -> tuple[int, int, int]:
        return self.Hv, self.dk, self.dv

    def core(self, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The mixer on x [B, hidden] with this layer's conv and state rows [B, ...] (advanced in place)."""
        B, Hk, Hv, dk, dv = x.shape[0], self.Hk, self.Hv, self.dk, self.dv
        dtype = x.dtype
        qkv, z, b, a = _mm(x, self.w, self.b).split([self.C, self.value_dim, Hv, Hv], dim=-1)
        qkv = _conv_step(conv, qkv, self.conv_w, self.conv_b)
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(B, Hk, dk), k.view(B, Hk, dk), v.view(B, Hv, dv)
        if Hk != Hv:
            q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q / (dk ** 0.5)
        beta = b.sigmoid().float()
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)  # [B, Hv]
        S = state if state.dtype == torch.float32 else state.float()
        S.mul_(g.exp()[..., None, None])
        kv_mem = torch.matmul(k[:, :, None, :], S)[:, :, 0]  # [B, Hv, dv]
        delta = (v - kv_mem) * beta[..., None]
        S.add_(k[..., None] * delta[:, :, None, :])
        out = torch.matmul(q[:, :, None, :], S)[:, :, 0]  # [B, Hv, dv]
        if S is not state:
            state.copy_(S)
        o = out.to(dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        o = (self.norm_w * o.to(dtype)) * F.silu(z.view(B, Hv, dv).float())
        return _mm(o.to(dtype).reshape(B, Hv * dv), self.o_w, self.o_b)


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


class _MLP:
    """silu(gate) * up, down, with gate and up fused; any other MLP (MoE) runs as its module."""

    def __init__(self, mlp: torch.nn.Module, fuse=_fuse):
        self.module = None
        act = getattr(mlp, "act_fn", None)
        probe = torch.randn(8)
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) and act is not None \
                and torch.allclose(act(probe), F.silu(probe)):
            self.n = mlp.gate_proj.out_features
            self.w, self.b = fuse([mlp.gate_proj, mlp.up_proj])
            self.d_w, self.d_b = fuse([mlp.down_proj])
        else:
            self.module = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            return self.module(x[:, None])[:, 0]
        gate, up = _mm(x, self.w, self.b).split([self.n, self.n], dim=-1)
        return _mm(F.silu(gate) * up, self.d_w, self.d_b)

    def native(self, x: torch.Tensor, ops) -> torch.Tensor:
        if self.module is not None:
            return self(x)
        return _mm(ops.silu_mul(_mm(x, self.w, self.b)), self.d_w, self.d_b)


class LeanDecodeStep:
    """`step(batch, token_ids, positions) -> logits [B, vocab] (fp32)`: one decode forward on a
    `DecodeBatch`'s rows (the batch has reserved room for the new column; it advances `lengths`).

    `ranges = True` wraps each part in a torch.profiler `record_function` (bench/decode.py splits the
    step by layer kind with it)."""

    def __init__(self, model: torch.nn.Module, adapter, packed: bool = False, kernel: str = "torch", native=None):
        if kernel not in KERNELS:
            raise ValueError(f"decode kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel != "torch" and native is None:
            raise ValueError(f"decode kernel {kernel!r} needs the native kernels (decode_matmul.native())")
        precision = {"native-f16": "f16", "native-i8": "i8"}.get(kernel, "f32")
        fuse = _fuse_native(native, precision) if kernel != "torch" else _fuse_packed if packed else _fuse
        self.packed = packed and kernel == "torch"
        self.kernel = kernel
        # The native kernels run the rest of the step too (norms, attention, Mamba2, the MLP's gate) on an
        # fp32 model; `ops = None` keeps those in torch (the reference they are tested against).
        self.ops = native if kernel != "torch" and model.dtype == torch.float32 else None
        base = model.base_model
        self.model = model
        self.rotary = getattr(base, "rotary_emb", None)
        self.final_norm = _Norm(getattr(base, "norm", None) or base.final_layernorm)
        self.lm_w, self.lm_b = fuse([model.get_output_embeddings()])  # a tied embedding table becomes a view too
        self.embed = base.embed_tokens.weight.detach()  # read after: a tied table is now that view
        attn_j = {i: j for j, i in enumerate(adapter.attention_layers)}
        lin_p = {i: p for p, i in enumerate(adapter.linear_layers)}
        self.layers = []
        for i, layer in enumerate(base.layers[: adapter.num_layers]):
            norm2 = getattr(layer, "post_attention_layernorm", None) or layer.pre_ff_layernorm
            if getattr(layer, "self_attn", None) is not None and i in attn_j:
                mixer, kind = _Attention(layer.self_attn, attn_j[i], model.config, fuse), "attention"
            elif getattr(layer, "mamba", None) is not None:
                mixer, kind = _Mamba2(layer.mamba, lin_p[i], fuse), "mamba2"
            elif getattr(layer, "linear_attn", None) is not None:
                mixer, kind = _GatedDeltaNet(layer.linear_attn, lin_p[i], fuse), "gated_deltanet"
            else:
                raise ValueError(f"layer {i} ({type(layer).__name__}): no mixer the lean step knows")
            mlp = getattr(layer, "mlp", None) or layer.feed_forward
            self.layers.append((_Norm(layer.input_layernorm), mixer, kind, _Norm(norm2), _MLP(mlp, fuse)))
        self.ranges = False
        self.blocks: dict | None = None  # compiled blocks (`compile`); None: eager

    @classmethod
    def build(cls, model: torch.nn.Module, adapter, packed: bool = False, kernel: str = "torch") -> "LeanDecodeStep | None":
        """The step for `model`, or None when its family is not covered (`uncovered_reason`). `packed`:
        a second copy of the weights packed for oneDNN, used from two rows on (faster at 2-8 rows on this
        CPU), when oneDNN is there. `kernel` (KERNELS): "torch" (torch's matmuls), "native" (the AVX2
        kernels of runner/decode_matmul.py on the fp32 weights; `packed` then has nothing to do),
        "native-f16" (the same on an fp16 copy of the weights: lossy) or "native-i8" (on a per-row int8 copy). A native kernel runs an fp32 model
        on the CPU where the kernels could be built; elsewhere the step keeps "torch" and logs why."""
        if uncovered_reason(model):
            return None
        if kernel not in KERNELS:
            raise ValueError(f"decode kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        native = None
        if kernel != "torch":
            from . import decode_matmul

            if model.dtype != torch.float32 or model.device.type != "cpu":
                log.warning("decode kernel %r runs fp32 models on the CPU; this one is %s on %s: torch's matmuls run",
                            kernel, model.dtype, model.device)
            else:
                native = decode_matmul.native()  # None: the reason was logged
            if native is None:
                kernel = "torch"
        return cls(model, adapter, packed=packed and torch.backends.mkldnn.is_available() and model.dtype == torch.float32,
                   kernel=kernel, native=native)

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.ranges else _NULL

    def __call__(self, batch, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        dev = self.embed.device
        s = _Step()
        s.b = b = len(batch.keys)
        s.width = max(batch.lengths) + 1
        s.same = batch.lengths[0] if min(batch.lengths) == s.width - 1 else None
        s.rows = s.cols = s.bias = s.cos = s.sin = None
        native = self.ops is not None and self.blocks is None
        if s.same is None and not native:  # rows of different lengths: each writes its own column, reads through a mask
            s.cols = torch.tensor(batch.lengths, dtype=torch.long, device=dev)
            s.rows = torch.arange(b, device=dev)
            hide = torch.arange(s.width, device=dev)[None, :] > s.cols[:, None]
            s.bias = torch.zeros(hide.shape, dtype=self.embed.dtype, device=dev).masked_fill_(
                hide, float("-inf"))[:, None, None, :]
        with self._range("embed+rope"):
            h = F.embedding(torch.tensor(list(token_ids), dtype=torch.long, device=dev), self.embed)
            if self.rotary is not None:
                pos = torch.tensor(list(positions), dtype=torch.long, device=dev)[:, None]
                cos, sin = self.rotary(h[:, None], pos)
                s.cos, s.sin = cos.view(b, 1, -1), sin.view(b, 1, -1)
        if self.blocks is not None:
            return self._blocks(h, batch, s)
        if native:
            return self._native(h, batch, s)
        for norm1, mixer, kind, norm2, mlp in self.layers:
            with self._range(kind):
                h = h + mixer(norm1(h), batch, s)
            with self._range("mlp"):
                h = h + mlp(norm2(h))
        with self._range("lm_head"):
            return _mm(self.final_norm(h), self.lm_w, self.lm_b).float()

    def _native(self, h: torch.Tensor, batch, s: _Step) -> torch.Tensor:
        """The layers on the native ops: each residual add fused with the norm after it, attention and
        Mamba2 mixers in one call each (the step's other mixers and MoE MLPs as in `__call__`)."""
        ops, d = self.ops, None
        lens = torch.tensor([n + 1 for n in batch.lengths], dtype=torch.long)
        if s.cos is not None:
            s.cos, s.sin = s.cos.reshape(s.b, -1).contiguous(), s.sin.reshape(s.b, -1).contiguous()
        for norm1, mixer, kind, norm2, mlp in self.layers:
            with self._range(kind):
                d = mixer.native(norm1.add_native(ops, h, d), batch, s, ops, lens)
            with self._range("mlp"):
                d = mlp.native(norm2.add_native(ops, h, d), ops)
        with self._range("lm_head"):
            return _mm(self.final_norm.add_native(ops, h, d), self.lm_w, self.lm_b).float()

    # --- compiled ------------------------------------------------------------------------------
    def compile_reason(self) -> str | None:
        """Why `compile` cannot take this step (None: it can)."""
        if self.packed:
            return "packed weights (oneDNN's opaque layout) are not compiled"
        if self.kernel != "torch":
            return f"the {self.kernel} kernel is called through ctypes, which inductor does not trace"
        if any(mlp.module is not None for *_, mlp in self.layers):
            return "an MLP runs as its module (MoE)"
        return None

    def compile(self, batch_sizes: Sequence[int] = (), options: dict | None = None, dynamic: bool = False,
                progress=None) -> None:
        """Run each step as a few `torch.compile`d blocks (inductor): a linear layer with its MLP; an
        attention layer's projections, and its output projection with the MLP; the final norm and
        lm_head. Attention over the live columns (its width grows every step) and the buffer writes
        stay eager. The blocks take the weights as arguments, so every layer of a kind shares one
        graph per batch size. `batch_sizes` are compiled now on dummy rows (`progress(msg)` told of
        each); any other size compiles when it first runs. `dynamic`: one graph for every batch size
        instead. Raises ValueError when `compile_reason` says so."""
        if (reason := self.compile_reason()) is not None:
            raise ValueError(f"cannot compile the lean step: {reason}")
        import torch._dynamo

        # one graph per block and batch size (and rope / gate variant): allow them all without a recompile fallback
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled = {name: torch.compile(fn, dynamic=dynamic, options=options or None) for name, fn in _BLOCKS.items()}
        self.blocks = compiled
        for b in batch_sizes:
            t0 = time.perf_counter()
            self._warm(b)
            if progress is not None:
                progress(f"lean decode step compiled for {b} row(s) in {time.perf_counter() - t0:.1f} s")

    def uncompile(self) -> None:
        """Back to the eager step (the compiled graphs are dropped)."""
        self.blocks = None

    def _warm(self, b: int) -> None:
        """Run every compiled block once on dummy rows of `b` (compiles what is not compiled yet)."""
        dev, dtype = self.embed.device, self.embed.dtype
        with torch.inference_mode():  # as the engine runs a step (an inference tensor is guarded apart)
            h = torch.zeros(b, self.embed.shape[1], dtype=dtype, device=dev)
            cos = sin = None
            if self.rotary is not None:
                c, sn = self.rotary(h[:, None], torch.zeros(b, 1, dtype=torch.long, device=dev))
                cos, sin = c.view(b, 1, -1), sn.view(b, 1, -1)
            for norm1, mixer, kind, norm2, mlp in self.layers:
                if kind == "attention":
                    q, k, v, gate = self.blocks["attention_in"](h, norm1, mixer, cos, sin)
                    self.blocks["attention_out"](h, q.reshape(b, -1).clone(), gate, mixer, norm2, mlp)
                else:  # rows of a larger buffer, as the batch passes them
                    conv, state = mixer.dummy_rows(b + 1)
                    self.blocks["linear"](h, conv[:b], state[:b], norm1, mixer, norm2, mlp)
            self.blocks["head"](h, self.final_norm, self.lm_w, self.lm_b)

    def _blocks(self, h: torch.Tensor, batch, s: _Step) -> torch.Tensor:
        blocks = self.blocks
        for norm1, mixer, kind, norm2, mlp in self.layers:
            with self._range(kind):
                if kind == "attention":
                    q, k, v, gate = blocks["attention_in"](h, norm1, mixer, s.cos, s.sin)
                    h = blocks["attention_out"](h, mixer.attend(q, k, v, batch, s), gate, mixer, norm2, mlp)
                else:
                    p = mixer.p
                    h = blocks["linear"](h, batch._conv[p][:s.b], batch._state[p][:s.b], norm1, mixer, norm2, mlp)
        with self._range("lm_head"):
            return blocks["head"](h, self.final_norm, self.lm_w, self.lm_b)


def _linear_block(h, conv, state, norm1, mixer, norm2, mlp):
    """A linear layer and its MLP, residuals included (advances `conv` and `state` in place)."""
    h = h + mixer.core(norm1(h), conv, state)
    return h + mlp(norm2(h))


def _attention_in(h, norm1, attn, cos, sin):
    return attn.project(norm1(h), cos, sin)


def _attention_out(h, out, gate, attn, norm2, mlp):
    h = h + attn.output(out, gate)
    return h + mlp(norm2(h))


def _head(h, norm, w, b):
    return _mm(norm(h), w, b).float()


_BLOCKS = {"linear": _linear_block, "attention_in": _attention_in, "attention_out": _attention_out, "head": _head}
