"""Canonical segment entries (docs/architecture.md).

An entry is one segment computed alone, from an empty state, at local positions 0..L-1.
Its first `seam` tokens (the seam head) are recomputed in every request; the body is cached:
- per attention layer: body K/V, keys rotated at local positions seam..L-1;
- per linear layer: the body's operator (T, E) and the conv tail (last inputs of the segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .operators import LinearOperator


@dataclass(frozen=True)
class SegmentEntry:
    """Immutable cached work of one segment. Tensors are never written after construction."""

    token_ids: tuple[int, ...]
    seam: int  # head length actually used: min(seam width, len(token_ids))
    keys: tuple[torch.Tensor, ...]  # per attention layer [H_kv, L - seam, D]
    values: tuple[torch.Tensor, ...]
    operators: tuple[LinearOperator, ...]  # per linear layer, body span; empty when the body is empty
    conv_tails: tuple[torch.Tensor, ...]  # per linear layer [C, min(L, K)]

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def body_length(self) -> int:
        return self.length - self.seam

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *self.conv_tails]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(op.nbytes for op in self.operators)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held for attention K/V, linear (T, E), and conv tails: capacity planning."""
        kv = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        te = sum(op.nbytes for op in self.operators)
        conv = sum(t.numel() * t.element_size() for t in self.conv_tails)
        return {"attention_kv": kv, "linear_TE": te, "conv_tail": conv}

    def to(self, device: torch.device | str) -> "SegmentEntry":
        """A copy with every tensor on `device` (the store tiers move entries with this)."""
        mv = lambda t: t.to(device)  # noqa: E731
        return SegmentEntry(
            self.token_ids,
            self.seam,
            tuple(map(mv, self.keys)),
            tuple(map(mv, self.values)),
            tuple(LinearOperator(mv(op.transition), mv(op.end)) for op in self.operators),
            tuple(map(mv, self.conv_tails)),
        )

    # --- flat tensor form, for serialization (safetensors) --------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map holding everything in the entry (token ids as int32)."""
        out = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int32), "seam": torch.tensor([self.seam])}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"attn.{i}.k"], out[f"attn.{i}.v"] = k.contiguous(), v.contiguous()
        for i, op in enumerate(self.operators):
            out[f"linear.{i}.T"], out[f"linear.{i}.E"] = op.transition.contiguous(), op.end.contiguous()
        for i, tail in enumerate(self.conv_tails):
            out[f"linear.{i}.conv"] = tail.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "SegmentEntry":
        """Inverse of `to_tensors`. Raises KeyError/ValueError on a malformed map."""
        n_attn = sum(1 for k in tensors if k.startswith("attn.") and k.endswith(".k"))
        n_ops = sum(1 for k in tensors if k.startswith("linear.") and k.endswith(".T"))
        n_conv = sum(1 for k in tensors if k.startswith("linear.") and k.endswith(".conv"))
        entry = cls(
            tuple(int(t) for t in tensors["token_ids"].tolist()),
            int(tensors["seam"][0]),
            tuple(tensors[f"attn.{i}.k"] for i in range(n_attn)),
            tuple(tensors[f"attn.{i}.v"] for i in range(n_attn)),
            tuple(LinearOperator(tensors[f"linear.{i}.T"], tensors[f"linear.{i}.E"]) for i in range(n_ops)),
            tuple(tensors[f"linear.{i}.conv"] for i in range(n_conv)),
        )
        if not 0 <= entry.seam <= entry.length:
            raise ValueError(f"entry seam {entry.seam} outside [0, {entry.length}]")
        if any(k.shape[-2] != entry.body_length for k in entry.keys):
            raise ValueError("entry key length does not match its body length")
        return entry
