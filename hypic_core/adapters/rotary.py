"""Moving cached attention keys to another position: RoPE re-rotation, or nothing under NoPE.

An adapter knows *whether* its model rotates keys (`ModelAdapter.uses_nope`, a family fact);
`KeyRotation` does the rotating, from the model's rotary embedding module read once. It is the
only place that knows the rotate-half layout of transformers' `apply_rotary_pos_emb`.
"""

from __future__ import annotations

import torch


class KeyRotation:
    """The rotary frequencies of one model (float64 on the CPU) and the attention scaling it applies.

    `inv_freq` None: the model's keys are position-free (NoPE) and every rotation is the identity.
    Stateless after construction; safe to share between threads.
    """

    def __init__(self, inv_freq: torch.Tensor | None, scaling: float = 1.0):
        self.inv_freq = inv_freq
        self.scaling = scaling

    @classmethod
    def of(cls, model: torch.nn.Module, nope: bool) -> "KeyRotation":
        """Read from `model.base_model.rotary_emb`; identity when `nope` or the model has none."""
        rotary = getattr(model.base_model, "rotary_emb", None)
        if rotary is None or nope:
            return cls(None)
        return cls(rotary.inv_freq.detach().to(torch.float64).cpu(), float(getattr(rotary, "attention_scaling", 1.0)))

    @property
    def dim(self) -> int:
        """How many leading head dims rotate (partial rotary leaves the rest); 0 under NoPE."""
        return 0 if self.inv_freq is None else 2 * self.inv_freq.numel()

    def move(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated at positions p, moved to p + delta. keys: [..., L, head_dim]; a new tensor
        unless nothing moves (NoPE or delta 0: `keys` itself).

        RoPE rotations compose (R(p + d) = R(d) R(p)), so every key turns by `delta` on the rotary
        dims, angles in float64 so large offsets keep their precision.
        """
        if self.inv_freq is None or delta == 0:
            return keys
        return self._rotate(keys, float(delta) * self.inv_freq, 1.0)

    def mover(self, deltas: torch.Tensor):
        """`move` for keys whose columns move by different amounts, the angles worked out once:
        returns f(keys [..., L, head_dim]) -> keys with column i moved by deltas[i] ([L] ints).
        A stitch moves every cached body by its own offset; one mover serves all its layers, so each
        layer rotates the bodies' keys in one pass. Column for column the same arithmetic as `move`."""
        if self.inv_freq is None or not bool((deltas != 0).any()):
            return lambda keys: keys
        cos, sin = self._tables(deltas.to(torch.float64)[:, None] * self.inv_freq[None, :], 1.0)
        return lambda keys: self._apply(keys, cos.to(keys.device), sin.to(keys.device))

    def at(self, keys_unrotated: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reference: rotate position-free keys [..., L, D] at absolute `positions` [L] (tests)."""
        if self.inv_freq is None:
            return keys_unrotated
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return self._rotate(keys_unrotated, angles, self.scaling)

    def _rotate(self, keys: torch.Tensor, angles: torch.Tensor, scale: float) -> torch.Tensor:
        """Rotate the rotary dims of `keys` by `angles` ([d/2] or [L, d/2], rotate-half layout), times `scale`."""
        cos, sin = self._tables(angles, scale)
        return self._apply(keys, cos.to(keys.device), sin.to(keys.device))

    @staticmethod
    def _tables(angles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin of float64 `angles` [..., d/2], laid out rotate-half ([..., d]), times `scale`."""
        cos = (torch.cat([angles.cos(), angles.cos()], -1) * scale).to(torch.float32)
        sin = (torch.cat([angles.sin(), angles.sin()], -1) * scale).to(torch.float32)
        return cos, sin

    def _apply(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d, half = self.dim, self.dim // 2
        rot = keys[..., :d].to(torch.float32)
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = keys.clone()
        out[..., :d] = (rot * cos + rotated_half * sin).to(keys.dtype)
        return out
