"""Full fine-tuning of a served model's decoder layers: the second rung of the reuse-training ladder.

Where LoRA (training/reuse/lora.py) trains low-rank corrections to the attention and mixer
projections, `FullTuning` trains every parameter of the decoder layers (attention, the linear
mixers' projections, convolutions and gates, the MLPs, the norms); the embeddings (tied to the
output head in the models served here) stay frozen. What is saved and shipped is the change:
`{"<parameter>.delta": tuned - original}` per parameter, which hypic_core/models/loader.py adds to
the checkpoint's weight on load, the same way it merges LoRA factors. A delta keeps the model's
layout (no new tensors), so a merged checkpoint loads in transformers and llama.cpp unchanged.

The interface is LoRA's as the trainer uses it: `parameters()`, `state()` / `load_state()` for
checkpoints, `exported()` for the adapter file, and `disabled()` (the original weights inside it).
"""

from __future__ import annotations

import torch
from torch import nn

from hypic_core.models.loader import DELTA  # the adapter file's name for a parameter's change

from .lora import decoder_layers


class FullTuning:
    """Marks `model`'s decoder-layer parameters trainable (everything else frozen) and keeps a copy
    of their original values, from which the deltas are taken. Mutates `model`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        layers = decoder_layers(model)
        prefix = "model.layers."
        self.named = {f"{prefix}{name}": p for name, p in layers.named_parameters()}
        if not self.named:
            raise ValueError(f"{type(model).__name__}: its decoder layers have no parameters to tune")
        for p in self.named.values():
            p.requires_grad_(True)
        self.original = {name: p.detach().clone() for name, p in self.named.items()}

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, in model order (the optimiser's)."""
        return list(self.named.values())

    def state(self) -> dict[str, torch.Tensor]:
        """`{"<parameter>.delta": tuned - original}` in the parameters' dtype (a checkpoint's)."""
        return {f"{name}{DELTA}": (p.detach() - self.original[name]) for name, p in self.named.items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter to original + its delta. Raises ValueError on a missing or misshaped delta."""
        with torch.no_grad():
            for name, p in self.named.items():
                delta = state.get(f"{name}{DELTA}")
                if delta is None:
                    raise ValueError(f"full-tuning state has no delta for {name}")
                if delta.shape != p.shape:
                    raise ValueError(f"{name}: delta {tuple(delta.shape)}, the model's {tuple(p.shape)}")
                p.copy_(self.original[name] + delta.to(p.dtype))

    def exported(self) -> dict[str, torch.Tensor]:
        """Every delta in bf16: what the adapter file holds (all of them, so `load_state` takes the file back)."""
        return {key: delta.to(torch.bfloat16).contiguous() for key, delta in self.state().items()}

    def disabled(self) -> "_Original":
        """Context manager: the original weights inside it, the tuned ones restored on exit."""
        return _Original(self)


class _Original:
    def __init__(self, tuning: FullTuning) -> None:
        self.tuning = tuning

    def __enter__(self):
        self.saved = {name: p.detach().clone() for name, p in self.tuning.named.items()}
        with torch.no_grad():
            for name, p in self.tuning.named.items():
                p.copy_(self.tuning.original[name])
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for name, p in self.tuning.named.items():
                p.copy_(self.saved[name])
