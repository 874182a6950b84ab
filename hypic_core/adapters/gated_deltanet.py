"""Gated DeltaNet hybrids: qwen3_5, qwen3_next, olmo_hybrid.

Recurrence per value head (state S is [d_k, d_v], keys L2-normalised inside the kernel):

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T

so A_t = exp(g_t)(I - b_t k_t k_t^T) and T is a dense [H_v, d_k, d_k] matrix. Inside the
canonical forward (the fused body), `chunk_scan_with_transition` runs the chunked scan and
multiplies up each chunk's transition from its UT form as it goes. The reference operator
(`GatedDeltaNetAdapter.operator`) runs the layer's own chunked kernel with values [v | 0] from
[0 | I], which ends in [E | T] (always its torch fallback, even where fla is installed:
adapters/kernels.py). `naive_scan` is the plain sequential reference beside both.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from ..algebra.operators import LinearOperator
from .base import Capture, ModelAdapter, StitchSpan, span_chunk
from .wrappers import recording_conv, stitch_conv, stitch_delta_scan
from .kernels import KernelSelection

_MODELING = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
}


class GatedDeltaNetAdapter(ModelAdapter):
    entry_state_cost = 20.0  # T's [d_k, d_k] work in the delta rule (fitted when an identity block was carried; adapters/base.py)
    family = "gated-deltanet"
    model_types = tuple(_MODELING)
    kernel_ops = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                  "torch_recurrent_gated_delta_rule")  # fla: chunk / fused_recurrent_gated_delta_rule

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._modeling = importlib.import_module(_MODELING[self.config.model_type])
        self.kernels = KernelSelection.install(self._modeling, self.kernel_ops)
        layers = self.model.base_model.layers
        self._mixers = [layers[i].linear_attn for i in self.linear_layers]

    # --- capture ------------------------------------------------------------------------
    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        mod = self._modeling
        conv_wrapper = recording_conv(cap, self.kernels.fallback("causal_conv1d_fn"))
        scan_fn = self.kernels.fallback("torch_chunk_gated_delta_rule")

        def scan_wrapper(query, key, value, *args, **kwargs):
            g = kwargs["g"] if "g" in kwargs else args[0]
            beta = kwargs["beta"] if "beta" in kwargs else args[1]
            cap.scan_args.append(
                dict(key=cap.keep(key), value=cap.keep(value), g=cap.keep(g), beta=cap.keep(beta),
                     use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False))
            )
            return scan_fn(query, key, value, *args, **kwargs)

        return {(mod, "causal_conv1d_fn"): conv_wrapper, (mod, "torch_chunk_gated_delta_rule"): scan_wrapper}

    supports_fused_body = True

    def _fused_patches(self, cap: Capture, seam: int, body_lengths: list[int]) -> dict[tuple[Any, str], Callable]:
        """Compute (T, E) inside the canonical forward's own kernel call, batched over rows.

        The kernel runs the seam heads [0, seam) as usual, then the bodies with
        `chunk_scan_with_transition`: the same chunked scan, which also multiplies up each chunk's
        [d_k, d_k] transition from the UT form, so the body's T comes with its output and S_L:
        no separate pass per operator. E = S_L - T S_w. Padding tokens get beta = 0 and g = 0,
        i.e. A_t = I and B_t = 0: they leave the state alone. (The plain reference, `operator`,
        runs the layer's kernel with values [v | 0] from [0 | I].)
        """
        mod = self._modeling
        conv_wrapper = recording_conv(cap, self.kernels.fallback("causal_conv1d_fn"))
        scan_fn = self.kernels.fallback("torch_chunk_gated_delta_rule")
        lengths = torch.tensor(body_lengths)

        def scan_wrapper(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
            B, L, hv, dv = value.shape
            dk = key.shape[-1]
            s_w = value.new_zeros(B, hv, dk, dv, dtype=torch.float32) if initial_state is None else initial_state.float()
            head_out = []
            if seam:
                out, s_w = scan_fn(query[:, :seam], key[:, :seam], value[:, :seam], g=g[:, :seam], beta=beta[:, :seam],
                                   chunk_size=span_chunk(seam), initial_state=s_w, output_final_state=True, **kwargs)
                head_out.append(out)
            q, k, v, g, beta = (x[:, seam:] for x in (query, key, value, g, beta))
            real = (torch.arange(L - seam)[None, :] < lengths[:, None]).to(value.device)[..., None]  # [B, Lb, 1]
            g, beta = g * real, beta * real
            out, s_l, T = chunk_scan_with_transition(
                q, k, v, g, beta, initial_state=s_w, chunk_size=kwargs.get("chunk_size", 64),
                use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False))
            cap.operators.append((T, s_l - torch.matmul(T, s_w)))
            out = torch.cat([*head_out, out], dim=1).contiguous()
            return out, (s_l.contiguous() if output_final_state else None)

        return {(mod, "causal_conv1d_fn"): conv_wrapper, (mod, "torch_chunk_gated_delta_rule"): scan_wrapper}

    supports_fused_stitch = True

    def _stitch_patches(self, cap: Capture, spans: list[StitchSpan], transition: bool) -> dict[tuple[Any, str], Callable]:
        """Run the recurrence span by span inside one layer call, applying each body's operator in between.

        The token-parallel work (projections, MLP) of every seam head and the question runs as
        one batch; only the recurrence and the short conv run per span, as in a sequential stitch.
        """
        mod = self._modeling
        return {(mod, "causal_conv1d_fn"): stitch_conv(cap, spans, self.kernels.fallback("causal_conv1d_fn"), self.conv_kernel),
                (mod, "torch_chunk_gated_delta_rule"):
                    stitch_delta_scan(spans, transition, self.kernels.fallback("torch_chunk_gated_delta_rule"))}

    # --- operators ----------------------------------------------------------------------
    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        ops = []
        for args in cap.scan_args:
            k, v, g, beta = (args[n][row : row + 1, start:end] for n in ("key", "value", "g", "beta"))
            ops.append(self.operator(k, v, g, beta, args["use_qk_l2norm_in_kernel"]))
        return ops

    def operator(self, k, v, g, beta, l2norm: bool) -> LinearOperator:
        """(T, E) of one span with the family's chunked kernel. k [1, L, Hk, dk], v [1, L, Hv, dv].

        One kernel call: the recurrence is linear in (state, values) jointly, so values [v | 0]
        from the state [0 | I] end in [E | T] (the keys' chunk work is shared by both).
        """
        kernel = self.kernels.fallback("torch_chunk_gated_delta_rule")
        _, L, _, dk = k.shape
        hv, dv = v.shape[2], v.shape[3]
        eye = torch.eye(dk, dtype=torch.float32, device=k.device).expand(1, hv, dk, dk)
        state = torch.cat([eye.new_zeros(1, hv, dk, dv), eye], dim=-1)
        values = torch.cat([v, v.new_zeros(1, L, hv, dk)], dim=-1)
        _, final = kernel(torch.zeros_like(k), k, values, g=g, beta=beta, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2norm)
        return LinearOperator(final[0, ..., dv:].float().contiguous(), final[0, ..., :dv].float().contiguous())

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        m = self._mixers[layer_pos]
        return (int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim))


def chunk_scan_with_transition(query, key, value, g, beta, initial_state=None, chunk_size: int = 64,
                               use_qk_l2norm_in_kernel: bool = False):
    """The chunked gated delta rule that also returns the span's transition T: (out, S_L, T) with
    S_L = T S_0 + E. Shapes as the layer's kernel: query/key [B, L, Hk, dk], value [B, L, Hv, dv],
    g and beta [B, L, Hv], initial_state [B, Hv, dk, dv]; T is [B, Hv, dk, dk].

    Per chunk c of the UT (WY) form the state update is S <- exp(G_c) S - K_c^T W_c S + K_c^T U_c
    (K_c the chunk's keys decayed to its end, W_c and U_c the solved keys and values), so the
    chunk's transition is exp(G_c) I - K_c^T W_c: a [dk, dk] product of quantities the scan
    already has, and T is their running product. Against running the scan with values [v | 0]
    from [S_0 | I] (`GatedDeltaNetAdapter.operator`, the reference), no value-width work is
    doubled: the outputs, the triangular solve and the state reads stay at d_v wide.
    """
    dtype, (hk, dk), (B, L, hv, dv) = query.dtype, key.shape[2:], value.shape
    if hk != hv:
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * dk ** -0.5
    pad = (chunk_size - L % chunk_size) % chunk_size
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    n = (L + pad) // chunk_size
    q, k, v = (x.reshape(B, hv, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(B, hv, n, chunk_size), g.reshape(B, hv, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)
    grow = cum.exp()[..., None]  # decay from the chunk's start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular once solved with unitriangular
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * grow, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * grow
    k_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    S = (torch.zeros(B, hv, dk, dv, device=q.device) if initial_state is None else initial_state.to(torch.float32))
    eye = torch.eye(dk, device=q.device)
    T = eye.expand(B, hv, dk, dk)
    out = torch.empty_like(u)
    for c in range(n):
        kt = k_end[:, :, c].transpose(-1, -2)
        v_new = u[:, :, c] - w[:, :, c] @ S
        out[:, :, c] = q[:, :, c] @ S + intra[:, :, c] @ v_new
        S = S * chunk_decay[:, :, c] + kt @ v_new
        T = (eye * chunk_decay[:, :, c] - kt @ w[:, :, c]) @ T
    out = out.reshape(B, hv, -1, dv)[:, :, :L].transpose(1, 2).contiguous().to(dtype)
    return out, S, T


def naive_scan(k, v, g, beta, initial_state=None, l2norm: bool = True) -> torch.Tensor:
    """Plain sequential gated delta rule, token by token, fp32. Returns the final state [B, Hv, dk, dv].

    Shapes as the kernel: k [B, L, Hk, dk], v [B, L, Hv, dv], g and beta [B, L, Hv].
    """
    k, v, g, beta = (x.to(torch.float32) for x in (k, v, g, beta))
    hv = v.shape[2]
    if k.shape[2] != hv:
        k = k.repeat_interleave(hv // k.shape[2], dim=2)
    if l2norm:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, L, _, dk = k.shape
    S = torch.zeros(B, hv, dk, v.shape[-1]) if initial_state is None else initial_state.to(torch.float32).clone()
    for t in range(L):
        kt, vt = k[:, t], v[:, t]  # [B, H, dk], [B, H, dv]
        S = S * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, (vt - pred) * beta[:, t, :, None])
    return S


__all__ = ["GatedDeltaNetAdapter", "chunk_scan_with_transition", "naive_scan"]
