"""Segment operators of affine state recurrences (docs/architecture.md).

A linear layer updates its state as S_t = A_t S_{t-1} + B_t, so a span maps any incoming
state affinely: S_out = T S_in + E. Operators compose associatively:

    (T1, E1) then (T2, E2) = (T2 T1, T2 E1 + E2)

Two transition shapes cover the supported families:
- dense:  T is [H, d_k, d_k], applied from the left to a state [H, d_k, d_v] (delta rules);
- scalar: T is [H], one decay per head, scaling a state [H, ...] (Mamba2 / SSD, lightning).

All arithmetic is fp32: bf16 loses ~2e-3 relative after 32 compositions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class LinearOperator:
    """The affine map (T, E) of one span through one linear layer. Immutable; tensors are fp32."""

    transition: torch.Tensor  # [H, d_k, d_k] (dense) or [H] (scalar)
    end: torch.Tensor  # [H, ...] state reached from a zero start

    @property
    def scalar(self) -> bool:
        return self.transition.dim() == 1

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """Return T @ state + E. `state` has the shape of `end`, optionally with a leading batch dim."""
        state = state.to(torch.float32)
        if self.scalar:
            shape = self.transition.shape + (1,) * (self.end.dim() - 1)
            return self.transition.view(shape) * state + self.end
        return torch.matmul(self.transition, state) + self.end

    def then(self, later: "LinearOperator") -> "LinearOperator":
        """The operator of this span followed by `later`'s span."""
        return LinearOperator(later._mul_transition(self.transition), later.apply(self.end))

    def _mul_transition(self, earlier: torch.Tensor) -> torch.Tensor:
        if self.scalar:
            return self.transition * earlier
        return torch.matmul(self.transition, earlier)

    @staticmethod
    def identity_like(op: "LinearOperator") -> "LinearOperator":
        if op.scalar:
            eye = torch.ones_like(op.transition)
        else:
            d = op.transition.shape[-1]
            eye = torch.eye(d, dtype=torch.float32, device=op.transition.device).expand_as(op.transition).clone()
        return LinearOperator(eye, torch.zeros_like(op.end))

    @property
    def nbytes(self) -> int:
        return self.transition.numel() * self.transition.element_size() + self.end.numel() * self.end.element_size()


def compose(ops: Iterable[LinearOperator]) -> LinearOperator:
    """Compose operators of consecutive spans, first to last (a left fold of `then`)."""
    it = iter(ops)
    try:
        acc = next(it)
    except StopIteration:
        raise ValueError("compose() needs at least one operator") from None
    for op in it:
        acc = acc.then(op)
    return acc


def compose_tree(ops: list[LinearOperator]) -> LinearOperator:
    """Same result as `compose`, reduced pairwise (log depth): the shape used for parallel cold spans."""
    if not ops:
        raise ValueError("compose_tree() needs at least one operator")
    while len(ops) > 1:
        ops = [ops[i].then(ops[i + 1]) if i + 1 < len(ops) else ops[i] for i in range(0, len(ops), 2)]
    return ops[0]
