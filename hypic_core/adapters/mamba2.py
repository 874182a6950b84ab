"""Mamba2 / SSD hybrids: bamba, granitemoehybrid (Granite 4.0-H), nemotron_h, zamba2, falcon_h1.

Recurrence per head h (state S is [head_dim, d_state], B_t shared by the heads of a group):

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)        a_h = -exp(A_log_h)
    S_t  = exp(dt_t a_h) S_{t-1} + dt_t x_t B_t^T

so A_t = exp(dt_t a_h) is one scalar per head, and a span's transition is the scalar
T_h = exp(a_h * sum_t dt_t). E is that recurrence from a zero state in closed form (one
weighted contraction over the span's tokens: `Mamba2Adapter.operator`); `naive_scan` is the
plain sequential reference beside it, and the layer's chunked scan computes the same state. The five families share the mixer code and differ
only in layout:

- bamba / granitemoehybrid / nemotron_h: separate Mamba and attention layers (Granite and
  Nemotron-H attention is NoPE; Nemotron-H also has MLP-only / MoE-only layers, no state);
- zamba2: "hybrid" layers run a shared attention block, then a Mamba mixer, on one cache layer;
- falcon_h1: every layer runs attention and Mamba in parallel on one cache layer.
A cache layer holding both is listed in `attention_layers` and in `linear_layers`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..algebra.operators import LinearOperator
from .base import Capture, ModelAdapter, StitchSpan, require, span_chunk
from .wrappers import advance_body, recording_conv, stitch_conv
from .kernels import KernelSelection

_MODELING = {
    "bamba": "transformers.models.bamba.modeling_bamba",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h",
    "zamba2": "transformers.models.zamba2.modeling_zamba2",
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1",
}
# config.layer_types entry -> (has attention K/V, has a Mamba state)
_LAYER_KINDS = {
    "linear_attention": (False, True),
    "full_attention": (True, False),
    "hybrid": (True, True),
    "mlp": (False, False),
    "moe": (False, False),
}


class Mamba2Adapter(ModelAdapter):
    entry_state_cost = 10.0  # E in closed form and the recorded scan inputs (adapters/base.py)
    family = "mamba2"
    model_types = tuple(_MODELING)
    kernel_ops = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan", "mamba2_selective_state_update",
                  "mamba2_split_conv1d_scan_combined")  # mamba_ssm; the last runs only in training without a cache

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._modeling = importlib.import_module(_MODELING[self.config.model_type])
        self.kernels = KernelSelection.install(self._modeling, self.kernel_ops)
        layers = self.model.base_model.layers
        self._mixers = [_find_mixer(layers[i]) for i in self.linear_layers]

    def _classify_layers(self) -> None:
        model_type = self.config.model_type
        for i, kind in enumerate(self.config.layer_types[: self.num_layers]):
            require(kind in _LAYER_KINDS, model_type, f"layer {i} has unknown type {kind!r}")
            attention, linear = _LAYER_KINDS[kind]
            if attention:
                self.attention_layers.append(i)
            if linear:
                self.linear_layers.append(i)

    # --- capture ------------------------------------------------------------------------
    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        mod = self._modeling
        conv_wrapper = recording_conv(cap, self.kernels.fallback("causal_conv1d_fn"))
        scan_fn = self.kernels.fallback("mamba2_chunk_scan")

        def scan_wrapper(hidden_states, dt, A, B, C, *args, **kwargs):
            cap.scan_args.append(dict(
                x=cap.keep(hidden_states), dt=cap.keep(dt), A=cap.keep(A), B=cap.keep(B),
                chunk_size=kwargs["chunk_size"] if "chunk_size" in kwargs else args[0],
                dt_bias=kwargs.get("dt_bias"), dt_softplus=kwargs.get("dt_softplus", False),
                dt_limit=kwargs.get("dt_limit", (0.0, float("inf")))))
            return scan_fn(hidden_states, dt, A, B, C, *args, **kwargs)

        return {(mod, "causal_conv1d_fn"): conv_wrapper, (mod, "mamba2_chunk_scan"): scan_wrapper}

    supports_fused_stitch = True

    def _stitch_patches(self, cap: Capture, spans: list[StitchSpan], transition: bool) -> dict[tuple[Any, str], Callable]:
        """Run the SSD scan span by span inside one layer call, applying each body's operator in between
        (T is one scalar per head, so a body costs one multiply-add of the state). A span of at most
        SHORT_SPAN tokens (every seam head, most questions) runs as one closed-form block (`SSDRun.block`,
        what the spans share prepared once per layer),
        a longer one through the layer's chunked scan, whose ~80 small ops per call made a warm
        stitch on the bundled hybrid ~11% slower. (All spans at once, one block-diagonal product per
        head, measured no faster than span by span: what is left per span is a few ops.)

        Projections, gated norm and MLP of every seam head and the question run as one batch.
        """
        mod = self._modeling
        scan_fn = self.kernels.fallback("mamba2_chunk_scan")
        calls = [0]

        def scan_wrapper(hidden_states, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, initial_states=None,
                         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
            lp = calls[0]
            calls[0] += 1
            b, _, h, p = hidden_states.shape
            state = (hidden_states.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32) if initial_states is None
                     else initial_states.float())
            outs = []
            run = None
            for span in spans:
                lo, hi = span.start, span.end
                if 0 < hi - lo <= SHORT_SPAN:  # a seam head or a short question: one closed-form block
                    run = run or SSDRun(hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
                    out, state = run.block(lo, hi, state)
                    outs.append(out)
                elif hi > lo:
                    out, state = scan_fn(hidden_states[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi],
                                         chunk_size=span_chunk(hi - lo, chunk_size), D=D, dt_bias=dt_bias,
                                         initial_states=state, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                         return_final_states=True, **kwargs)
                    outs.append(out)
                state = advance_body(state, span, lp, transition)
            out = torch.cat(outs, dim=1)  # contiguous: callers view() it
            return (out, state) if return_final_states else out

        return {(mod, "causal_conv1d_fn"): stitch_conv(cap, spans, self.kernels.fallback("causal_conv1d_fn"), self.conv_kernel),
                (mod, "mamba2_chunk_scan"): scan_wrapper}

    # --- operators ----------------------------------------------------------------------
    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        ops = []
        for a in cap.scan_args:
            x, dt, B = (a[n][row : row + 1, start:end].contiguous() for n in ("x", "dt", "B"))  # GPU kernels want dense
            ops.append(self.operator(x, dt, a["A"], B, a["dt_bias"], a["dt_softplus"], a["dt_limit"], a["chunk_size"]))
        return ops

    def operator(self, x, dt, A, B, dt_bias, dt_softplus: bool, dt_limit, chunk_size: int) -> LinearOperator:
        """(T, E) of one span. x [1, L, H, P], dt [1, L, H] (raw), A [H], B [1, L, G, N].

        T [H] = exp(a_h * sum of effective dt). E [H, P, N] in closed form, the recurrence from a
        zero state unrolled: E = sum_t exp(a_h * sum_{s>t} dt_s) dt_t x_t B_t^T, one contraction over
        the span's tokens. The chunked scan computes the same state plus every token's output
        (with C = 0: wasted), about twice the work; `chunk_size` is unused, kept for the signature.
        """
        step = effective_dt(dt[0], dt_bias, dt_softplus, dt_limit)  # [L, H]
        log_decay = A.float()[None, :] * step  # [L, H], <= 0
        # sum_{s>t}: a reverse cumulative sum shifted by one, so no difference of large sums.
        after = torch.cat([log_decay[1:].flip(0).cumsum(0).flip(0), log_decay.new_zeros(1, log_decay.shape[1])])
        T = torch.exp(log_decay.sum(0))
        L, H, P = x.shape[1:]
        G, N = B.shape[2:]
        w = (torch.exp(after) * step).view(L, G, H // G, 1)
        xw = (x[0].float().view(L, G, H // G, P) * w).reshape(L, G, (H // G) * P)  # [L, G, J*P]
        E = torch.bmm(xw.permute(1, 2, 0), B[0].float().permute(1, 0, 2))  # [G, J*P, N]
        return LinearOperator(T, E.view(H, P, N))

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        m = self._mixers[layer_pos]
        return (int(m.num_heads), int(m.head_dim), int(m.ssm_state_size))


def _find_mixer(layer: torch.nn.Module) -> torch.nn.Module:
    """The Mamba2 mixer inside a decoder layer: the submodule holding A_log and the conv."""
    for module in layer.modules():
        if hasattr(module, "A_log") and hasattr(module, "conv1d") and hasattr(module, "ssm_state_size"):
            return module
    raise ValueError(f"no Mamba2 mixer in {type(layer).__name__}")


def effective_dt(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """The step the scan uses: clamp(softplus(dt + dt_bias), dt_limit), fp32. dt [..., H]."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


SHORT_SPAN = 64  # spans up to this long run `ssd_span` in a stitch; longer ones the layer's chunked scan


def ssd_span(x, dt, A, B, C, D=None, dt_bias=None, initial_states=None, dt_softplus: bool = False,
             dt_limit=(0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan's (output, final state) for a short span as ONE block, in closed form, fp32.

    Shapes as the kernel: x [b, L, H, P], dt [b, L, H] (raw), A [H], B and C [b, L, G, N],
    initial_states [b, H, P, N] or None. With c_t = sum_{s<=t} dt_s a (the log decay):

        S_t = exp(c_t) S_0 + sum_{s<=t} exp(c_t - c_s) dt_s x_s B_s^T,     y_t = C_t S_t + D x_t

    so the outputs are one [L, L] product per head plus S_0's share, and the final state one
    weighted contraction. This is the kernel's own arithmetic for a span that fits one chunk (the
    decays c_t - c_s as segment sums, as the kernel takes them), without its chunking, padding and
    inter-chunk pass; meant for L up to a few dozen tokens ([L, L] per head).
    Reference: the layer's `mamba2_chunk_scan` (tests/engine/test_families_operators.py).
    """
    y, final = SSDRun(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit).block(0, x.shape[1], initial_states)
    return y.contiguous(), final


class SSDRun:
    """A fused stitch's run through one Mamba2 layer: what every span shares (step sizes, x dt, B and C
    per head, D x) worked out once for the whole run, then `block(lo, hi, state)` per span (`ssd_span`'s
    arithmetic on tokens [lo, hi))."""

    def __init__(self, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, float("inf"))):
        per_group = x.shape[2] // B.shape[2]
        self.step = effective_dt(dt, dt_bias, dt_softplus, dt_limit).transpose(1, 2)  # [b, H, R]
        self.log_decay = self.step * A.float()[:, None]  # [b, H, R]
        xf = x.float().transpose(1, 2)  # [b, H, R, P]
        self.xdt = xf * self.step[..., None]
        self.xD = None if D is None else xf * D.float()[:, None, None]
        self.Bh = B.float().repeat_interleave(per_group, dim=2).transpose(1, 2)  # [b, H, R, N]
        self.Ch = C.float().repeat_interleave(per_group, dim=2).transpose(1, 2)

    def block(self, lo: int, hi: int, initial_states=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [b, hi - lo, H, P], a view; state after token hi - 1 [b, H, P, N]) from `initial_states` (None: zero)."""
        L = hi - lo
        a = self.log_decay[..., lo:hi]  # [b, H, L]
        cum = torch.cumsum(a, dim=-1)  # c_t
        xdt, Bh, Ch = self.xdt[:, :, lo:hi], self.Bh[:, :, lo:hi], self.Ch[:, :, lo:hi]
        # c_t - c_s as a sum over (s, t] (the kernel's segment sum), not a difference of running sums,
        # which loses digits once the decay has run far; -inf above the diagonal. No in-place op on
        # what autograd keeps: a stitch also runs under autograd (training on what hypic serves).
        strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril_(-1)  # [r, s]: r > s
        seg = a[..., :, None].expand(*a.shape, L).masked_fill(~strict, 0.0).cumsum(dim=-2)  # [b, H, t, s]
        seg = seg.masked_fill(~(strict | torch.eye(L, dtype=torch.bool, device=a.device)), float("-inf"))
        y = torch.matmul(torch.matmul(Ch, Bh.transpose(-1, -2)) * seg.exp(), xdt)  # [b, H, L, P]
        final = torch.matmul((xdt * seg[..., -1, :].exp()[..., None]).transpose(-1, -2), Bh)  # [b, H, P, N]
        if initial_states is not None:
            S0 = initial_states.float()
            if torch.is_grad_enabled():  # the mixer copies the final state into the cache tensor this may be: keep our own
                S0 = S0.clone()
            y = y + torch.matmul(Ch, S0.transpose(-1, -2)) * cum.exp()[..., None]
            final = final + S0 * cum[..., -1:].exp()[..., None]
        if self.xD is not None:
            y = y + self.xD[:, :, lo:hi]
        return y.transpose(1, 2), final


def naive_scan(x, dt, A, B, dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, float("inf")),
               initial_state=None) -> torch.Tensor:
    """Plain sequential Mamba2 recurrence, token by token, fp32. Returns the final state [B, H, P, N].

    Shapes as the kernel: x [B, L, H, P], dt [B, L, H] (raw), A [H], B [B, L, G, N].
    """
    batch, L, H, P = x.shape
    Bh = B.float().repeat_interleave(H // B.shape[2], dim=2)  # [B, L, H, N]
    step = effective_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, L, H]
    S = (torch.zeros(batch, H, P, B.shape[-1]) if initial_state is None
         else initial_state.to(torch.float32).clone())
    for t in range(L):
        decay = torch.exp(step[:, t] * A.float())  # [B, H]
        S = decay[..., None, None] * S + step[:, t, :, None, None] * x[:, t].float()[..., None] * Bh[:, t, :, None, :]
    return S


__all__ = ["Mamba2Adapter", "SSDRun", "effective_dt", "naive_scan", "ssd_span"]
