"""Kimi delta attention hybrids: kimi_linear (Kimi-Linear).

Recurrence per head (state S is [d_k, d_v], keys L2-normalised inside the kernel), with a
decay per key channel instead of GDN's one per head:

    S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T        g_t in R^{d_k}, g_t < 0

so A_t = (I - b_t k_t k_t^T) diag(exp(g_t)) and T is a dense [H, d_k, d_k] matrix applied from
the left. T comes from the layer's own chunked kernel (the torch `chunk_kimi_delta_attention`,
even where FLA's `chunk_kda` is installed: adapters/kernels.py): one call started from [I | 0]
with values [0 | v] gives [T | E]. Canonical entries compute it inside the forward's own kernel
call instead (`_fused_patches`, as Gated DeltaNet). `naive_scan` is the plain sequential
reference beside it.

Attention layers are MLA without positions: the cache holds the compressed latent
(`keys` [B, 1, L, kv_lora_rank]) and the shared key part (`values` [B, 1, L, qk_rope_head_dim]),
both position-free, so cached entries need no rotation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..algebra.operators import LinearOperator
from .base import Capture, ModelAdapter, StitchSpan, span_chunk
from .wrappers import recording_conv, stitch_conv, stitch_delta_scan
from .kernels import KernelSelection


class KimiDeltaAttentionAdapter(ModelAdapter):
    entry_state_cost = 20.0  # the identity block [S_w | I] carried through the delta rule (adapters/base.py)
    family = "kimi-delta-attention"
    model_types = ("kimi_linear",)
    kernel_ops = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_kimi_delta_attention",
                  "recurrent_kimi_delta_attention")  # fla: chunk_kda / fused_recurrent_kda

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        from transformers.models.kimi_linear import modeling_kimi_linear

        self._modeling = modeling_kimi_linear
        self.kernels = KernelSelection.install(self._modeling, self.kernel_ops)
        layers = self.model.base_model.layers
        self._mixers = [layers[i].self_attn for i in self.linear_layers]

    @property
    def uses_nope(self) -> bool:
        return True

    # --- capture ------------------------------------------------------------------------
    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        mod = self._modeling
        conv_wrapper = recording_conv(cap, self.kernels.fallback("causal_conv1d_fn"))
        scan_fn = self.kernels.fallback("chunk_kimi_delta_attention")

        def scan_wrapper(query, key, value, g, beta, *args, **kwargs):
            cap.scan_args.append(dict(key=cap.keep(key), value=cap.keep(value), g=cap.keep(g), beta=cap.keep(beta),
                                      use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False)))
            return scan_fn(query, key, value, g, beta, *args, **kwargs)

        return {(mod, "causal_conv1d_fn"): conv_wrapper, (mod, "chunk_kimi_delta_attention"): scan_wrapper}

    supports_fused_body = True

    def _fused_patches(self, cap: Capture, seam: int, body_lengths: list[int]) -> dict[tuple[Any, str], Callable]:
        """(T, E) inside the canonical forward's own kernel call, batched over rows, as Gated DeltaNet:
        the seam heads [0, seam) run as usual, then the bodies with values [v | 0] from [S_w | I],
        which end in [S_L | T]; E = S_L - T S_w. Padding gets beta = 0 and g = 0 (A_t = I, no input)."""
        mod = self._modeling
        conv_wrapper = recording_conv(cap, self.kernels.fallback("causal_conv1d_fn"))
        scan_fn = self.kernels.fallback("chunk_kimi_delta_attention")
        lengths = torch.tensor(body_lengths)

        def scan_wrapper(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                         **kwargs):
            B, L, h, dv = value.shape
            dk = key.shape[-1]
            s_w = value.new_zeros(B, h, dk, dv, dtype=torch.float32) if initial_state is None else initial_state.float()
            head_out = []
            if seam:
                out, s_w = scan_fn(query[:, :seam], key[:, :seam], value[:, :seam], g[:, :seam], beta[:, :seam],
                                   chunk_size=span_chunk(seam, chunk_size), initial_state=s_w, output_final_state=True,
                                   **kwargs)
                head_out.append(out)
            q, k, v, g, beta = (x[:, seam:] for x in (query, key, value, g, beta))
            real = (torch.arange(L - seam)[None, :] < lengths[:, None]).to(value.device)[..., None]  # [B, Lb, 1]
            g, beta = g * real[..., None], beta * real
            values = torch.cat([v, v.new_zeros(B, L - seam, h, dk)], dim=-1)
            eye = torch.eye(dk, dtype=torch.float32, device=value.device).expand(B, h, dk, dk)
            out, state = scan_fn(q, k, values, g, beta, chunk_size=chunk_size, initial_state=torch.cat([s_w, eye], dim=-1),
                                 output_final_state=True, **kwargs)
            s_l, T = state[..., :dv], state[..., dv:]
            cap.operators.append((T, s_l - torch.matmul(T, s_w)))
            out = torch.cat([*head_out, out[..., :dv]], dim=1).contiguous()
            return out, (s_l.contiguous() if output_final_state else None)

        return {(mod, "causal_conv1d_fn"): conv_wrapper, (mod, "chunk_kimi_delta_attention"): scan_wrapper}

    supports_fused_stitch = True

    def _stitch_patches(self, cap: Capture, spans: list[StitchSpan], transition: bool) -> dict[tuple[Any, str], Callable]:
        """As Gated DeltaNet: the KDA recurrence runs span by span inside the layer's one kernel call,
        each body's (T, E) applied in between; the short conv continues across spans."""
        mod = self._modeling
        return {(mod, "causal_conv1d_fn"): stitch_conv(cap, spans, self.kernels.fallback("causal_conv1d_fn"), self.conv_kernel),
                (mod, "chunk_kimi_delta_attention"):
                    stitch_delta_scan(spans, transition, self.kernels.fallback("chunk_kimi_delta_attention"))}

    # --- operators ----------------------------------------------------------------------
    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        ops = []
        for a in cap.scan_args:
            k, v, g, beta = (a[n][row : row + 1, start:end].contiguous() for n in ("key", "value", "g", "beta"))
            ops.append(self.operator(k, v, g, beta, a["use_qk_l2norm_in_kernel"]))
        return ops

    def operator(self, k, v, g, beta, l2norm: bool) -> LinearOperator:
        """(T, E) of one span with the family's chunked kernel. k, g [1, L, H, dk], v [1, L, H, dv], beta [1, L, H]."""
        kernel = self.kernels.fallback("chunk_kimi_delta_attention")
        _, L, h, dk = k.shape
        # Value columns evolve independently under the same A_t, so one call from [I | 0] with
        # values [0 | v] yields [T | E]: the first dk columns never receive input.
        start = torch.zeros((1, h, dk, dk + v.shape[-1]), dtype=torch.float32, device=k.device)
        start[..., :dk] = torch.eye(dk, dtype=torch.float32, device=k.device)
        values = torch.cat([torch.zeros((1, L, h, dk), dtype=v.dtype, device=v.device), v], dim=-1)
        _, state = kernel(torch.zeros_like(k), k, values, g=g, beta=beta, initial_state=start,
                          output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        state = state[0].float()
        return LinearOperator(state[..., :dk].contiguous(), state[..., dk:].contiguous())

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        m = self._mixers[layer_pos]
        return (int(m.num_heads), int(m.head_dim), int(m.head_dim))

    def decay_parameters(self, layer_pos: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """(A_log, dt_bias) of a KDA layer's forget gate: what tests set to make heads decay slowly."""
        gate = self._mixers[layer_pos].forget_gate
        return gate.A_log, gate.dt_bias


def naive_scan(k, v, g, beta, initial_state=None, l2norm: bool = True) -> torch.Tensor:
    """Plain sequential Kimi delta rule, token by token, fp32. Returns the final state [B, H, dk, dv].

    Shapes as the kernel: k, g [B, L, H, dk], v [B, L, H, dv], beta [B, L, H].
    """
    k, v, g, beta = (x.to(torch.float32) for x in (k, v, g, beta))
    if l2norm:
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, L, H, dk = k.shape
    S = torch.zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.to(torch.float32).clone()
    for t in range(L):
        S = S * g[:, t].exp()[..., None]  # per key channel: rows of S
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - pred) * beta[:, t, :, None])
    return S


__all__ = ["KimiDeltaAttentionAdapter", "naive_scan"]
