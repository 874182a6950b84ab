"""Lightning-attention hybrids: minimax (MiniMax-Text-01 / M1 layout).

Recurrence per head h (state S is [d, d]; k_t, v_t are the SiLU-activated projections, no
normalisation, no conv), with a decay fixed per head and layer (`slope_rate`, ALiBi-like):

    S_t = lambda_h S_{t-1} + k_t^T v_t        lambda_h = exp(-slope_h)

so A_t is one scalar per head and a span of L tokens has T_h = exp(-slope_h L) and
E = sum_t lambda_h^(L-1-t) k_t^T v_t, computed here in one fp32 contraction. The layer has no
kernel function to patch: its inputs are recorded through the module's
`apply_mask_to_padding_states`, which receives the activated q/k/v of every lightning layer.
`naive_scan` is the plain sequential reference beside it.

MiniMax keeps linear states in its own cache class (`MiniMaxCache.linear_cache`, created
lazily per layer) and has no conv. Its K/V layers are created lazily too, and the stock class
reads the sequence length from layer 0, which is a lightning layer in the released
checkpoints: a continued forward would then build a mask as if the cache were empty. The
cache built here reads it from the first full-attention layer instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.models.minimax import modeling_minimax

from ..algebra.operators import LinearOperator
from .base import Capture, ModelAdapter, StitchSpan, require
from .wrappers import advance_body


class LightningAdapter(ModelAdapter):
    family = "lightning"
    model_types = ("minimax",)

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._modeling = modeling_minimax
        require(not getattr(self.config, "sliding_window", None), self.config.model_type,
                "sliding-window attention drops old keys, so cached keys cannot be reused at any offset")
        require(bool(self.attention_layers), self.config.model_type, "no full-attention layer to carry positions")
        layers = self.model.base_model.layers
        self._mixers = [layers[i].self_attn for i in self.linear_layers]

    def new_cache(self):
        return PositionedMiniMaxCache(self.attention_layers[0])

    # --- capture ------------------------------------------------------------------------
    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        mod = self._modeling
        mask_fn = mod.apply_mask_to_padding_states

        def qkv_wrapper(qkv_states, attention_mask):
            out = mask_fn(qkv_states, attention_mask)
            m = self._mixers[len(cap.scan_args)]
            q, k, v = cap.keep(out).reshape(*out.shape[:2], m.num_attention_heads, 3, m.head_dim).unbind(3)
            cap.scan_args.append(dict(key=k, value=v))
            return out

        return {(mod, "apply_mask_to_padding_states"): qkv_wrapper}

    supports_fused_stitch = True

    def _stitch_patches(self, cap: Capture, spans: list[StitchSpan], transition: bool) -> dict[tuple[Any, str], Callable]:
        """Replace the lightning layers' forward for one fused stitch: the recurrence runs span by span
        (block-wise, `lightning_scan`), each body's (T, E) applied in between. The stock forward would
        run token by token once a state is cached; projections, norm and gate are the stock ones."""
        adapter, positions = self, {m.layer_idx: p for p, m in enumerate(self._mixers)}

        def forward(mixer, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            lp = positions[mixer.layer_idx]
            b, n, _ = hidden_states.shape
            h, d = mixer.num_attention_heads, mixer.head_dim
            qkv = mixer.act_fn(mixer.qkv_proj(hidden_states)).reshape(b, n, h, 3 * d)
            q, k, v = torch.split(qkv, d, dim=3)
            _, state = adapter.linear_state_or_zero(cache, lp)
            state, slopes, outs = state[None].float(), adapter.slopes(lp), []
            for span in spans:
                lo, hi = span.start, span.end
                if hi > lo:
                    out, state = lightning_scan(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], slopes, state, mixer.block_size)
                    outs.append(out)
                state = advance_body(state, span, lp, transition)
            out = torch.cat(outs, dim=1).to(hidden_states.dtype).reshape(b, n, h * d)
            out = torch.sigmoid(mixer.output_gate(hidden_states)) * mixer.norm(out)
            cache.set_linear_cache(mixer.layer_idx, state.to(hidden_states.dtype))
            return mixer.out_proj(out), state

        return {(type(self._mixers[0]), "forward"): forward}

    def conv_tail(self, cap: Capture, layer_pos: int, row: int, end: int) -> torch.Tensor:
        return self._no_conv()

    def _no_conv(self) -> torch.Tensor:
        return torch.zeros((0, 0), dtype=self.model.dtype, device=self.model.device)

    # --- operators ----------------------------------------------------------------------
    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        return [self.operator(a["key"][row, start:end], a["value"][row, start:end], self.slopes(p))
                for p, a in enumerate(cap.scan_args)]

    @staticmethod
    def operator(k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> LinearOperator:
        """(T, E) of one span. k, v [L, H, d]; slopes [H]. T [H] = exp(-slope L); E [H, d, d]."""
        L = k.shape[0]
        slopes = slopes.float()
        age = torch.arange(L - 1, -1, -1, dtype=torch.float32, device=k.device)  # tokens after t
        weight = torch.exp(-age[:, None] * slopes[None, :])  # [L, H]
        E = torch.einsum("lhk,lh,lhv->hkv", k.float(), weight, v.float())
        return LinearOperator(torch.exp(-slopes * L), E)

    def slopes(self, layer_pos: int) -> torch.Tensor:
        """Per-head decay rates of a lightning layer, [H] (the buffer is [H, 1, 1])."""
        return self._mixers[layer_pos].slope_rate.reshape(-1)

    def set_slopes(self, layer_pos: int, slopes: torch.Tensor) -> None:
        """Replace a layer's decay rates [H] and the block decay buffers derived from them (tests: slow heads)."""
        m = self._mixers[layer_pos]
        rate = slopes.to(m.slope_rate)[:, None, None]
        query_decay, key_decay, diagonal_decay = m.decay_factors(rate)
        for name, value in (("slope_rate", rate), ("query_decay", query_decay), ("key_decay", key_decay),
                            ("diagonal_decay", diagonal_decay)):
            getattr(m, name).copy_(value)

    def conv_kernel(self, layer_pos: int) -> int:
        return 0

    def conv_shape(self, layer_pos: int) -> tuple[int, int]:
        return (0, 0)

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        m = self._mixers[layer_pos]
        return (int(m.num_attention_heads), int(m.head_dim), int(m.head_dim))

    def linear_state_or_zero(self, cache, layer_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(empty conv, state [H, d, d]) of batch row 0; a zero state is installed if the layer has none."""
        idx = self.linear_layers[layer_pos]
        state = cache.linear_cache[idx] if idx < len(cache.linear_cache) else []
        if isinstance(state, list):  # MiniMaxCache marks a layer without state with []
            state = torch.zeros((1, *self.state_shape(layer_pos)), dtype=self.model.dtype, device=self.model.device)
            cache.set_linear_cache(idx, state)
        return self._no_conv(), state[0]

    def write_linear_state(self, cache, layer_pos: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        cache.linear_cache[self.linear_layers[layer_pos]][0].copy_(state)

    def linear_rows(self, cache, layer_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = cache.linear_cache[self.linear_layers[layer_pos]]
        return self._no_conv()[None].expand(state.shape[0], -1, -1), state

    def bind_linear_rows(self, cache, layer_pos: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        # MiniMax's forward replaces the state with a new tensor each step; the decode batch adopts it.
        cache.set_linear_cache(self.linear_layers[layer_pos], state)


class PositionedMiniMaxCache(modeling_minimax.MiniMaxCache):
    """A MiniMaxCache whose sequence length (default positions, mask sizes) comes from a full-attention layer."""

    def __init__(self, attention_layer: int):
        super().__init__()
        self.attention_layer = attention_layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx or self.attention_layer)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, layer_idx or self.attention_layer)


def lightning_scan(q, k, v, slopes, state, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention over a span from `state`, block by block, fp32 (the model's own block form).

    q, k, v [B, L, H, d]; slopes [H]; state [B, H, d, d]. Returns (outputs [B, L, H, d], final state):
    o_t = q_t S_t with S_t = exp(-slope) S_{t-1} + k_t^T v_t.
    """
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, L, d]
    s = slopes.float().view(-1, 1)  # [H, 1]
    outs = []
    for lo in range(0, q.shape[2], block_size):
        qb, kb, vb = q[:, :, lo:lo + block_size], k[:, :, lo:lo + block_size], v[:, :, lo:lo + block_size]
        n = qb.shape[2]
        idx = torch.arange(n, dtype=torch.float32, device=q.device)
        age = idx[:, None] - idx[None, :]
        diagonal = torch.exp(-s[..., None] * age.clamp_min(0)).masked_fill(age < 0, 0.0)  # [H, n, n]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        inter = torch.matmul(qb * torch.exp(-s * (idx + 1))[..., None], state)
        outs.append(intra + inter)
        state = torch.exp(-s * n)[..., None] * state + torch.matmul(
            (kb * torch.exp(-s * (n - 1 - idx))[..., None]).transpose(-1, -2), vb)
    return torch.cat(outs, dim=2).transpose(1, 2), state


def naive_scan(k, v, slopes, initial_state=None) -> torch.Tensor:
    """Plain sequential lightning recurrence, token by token, fp32. k, v [L, H, d]; returns [H, d, d]."""
    k, v = k.float(), v.float()
    decay = torch.exp(-slopes.float())[:, None, None]
    S = torch.zeros(k.shape[1], k.shape[2], v.shape[2]) if initial_state is None else initial_state.float().clone()
    for t in range(k.shape[0]):
        S = decay * S + k[t][:, :, None] * v[t][:, None, :]
    return S


__all__ = ["LightningAdapter", "PositionedMiniMaxCache", "lightning_scan", "naive_scan"]
