"""Model-family adapters and the registry that picks one for a loaded model."""

from __future__ import annotations

import torch

from ..errors import UnsupportedArchitectureError
from .base import Capture, ModelAdapter
from .dense import DenseAdapter
from .gated_deltanet import GatedDeltaNetAdapter
from .kimi import KimiDeltaAttentionAdapter
from .lightning import LightningAdapter
from .mamba2 import Mamba2Adapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (
    GatedDeltaNetAdapter, Mamba2Adapter, KimiDeltaAttentionAdapter, LightningAdapter, DenseAdapter,
)

# Hybrids transformers cannot resume from a cached state in a multi-token forward.
_NOT_RESUMABLE = {
    "jamba": "its Mamba1 torch fallback has no initial-state input (the cached state is only used one token at a time)",
    "zamba": "its Mamba1 torch fallback has no initial-state input (the cached state is only used one token at a time)",
    "recurrent_gemma": "its recurrent state lives on the modules and position_ids == 0 resets it",
}


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """Return the adapter for `model`, or raise UnsupportedArchitectureError naming its type and why."""
    model_type = getattr(model.config, "model_type", "<unknown>")
    if model_type in _NOT_RESUMABLE:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported: transformers cannot resume it from a cached "
            f"state in a multi-token forward ({_NOT_RESUMABLE[model_type]})"
        )
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    known = sorted(t for cls in ADAPTERS for t in cls.model_types)
    raise UnsupportedArchitectureError(
        f"model type {model_type!r} is not supported: no adapter knows how to cache its layers "
        f"(supported: {', '.join(known)})"
    )


__all__ = ["ADAPTERS", "Capture", "ModelAdapter", "adapter_for"]
