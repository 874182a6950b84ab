"""LoRA adapters on a served model's attention and linear-mixer projections, merged at export.

`attach(model, rank)` wraps every adapted linear of the decoder layers in a `LoRA` module (the
frozen original plus `scale * up @ down`, `up` zero at the start, so a fresh adapter computes the
model exactly); `factors(model)` is what is trained and shipped; `merged_state(model)` is the
model's own state dict with each correction added into its linear's weight, so an exported
checkpoint keeps the model's layout (the one llama.cpp and transformers load) with no new tensors.

Adapted linears (by the module's own name inside a decoder layer): attention `q_proj`, `k_proj`,
`v_proj`, `o_proj`, and the linear mixers' input and output projections (`in_proj*`, `out_proj`:
Mamba2's `in_proj` / `out_proj`, Gated DeltaNet's `in_proj_qkvz` ...). MLPs are left alone.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

ADAPTED = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|in_proj\w*|out_proj)$")


class LoRA(nn.Module):
    """`base(x) + scale * (x @ down.T) @ up.T` with `base` frozen; `weight` is the merged matrix
    (for code that reads a linear's weight instead of calling it)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, seed: int) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        dtype = base.weight.dtype
        self.down = nn.Parameter(torch.randn(rank, base.in_features, generator=gen).to(dtype) / math.sqrt(base.in_features))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype))
        self.scale = alpha / rank
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight + self.delta()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def delta(self) -> torch.Tensor:
        return self.scale * (self.up @ self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * ((x @ self.down.T) @ self.up.T)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (`model.model.layers` in every family the engine serves)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers; LoRA cannot be attached")
    return layers


def adapted_names(model: nn.Module) -> list[str]:
    """Full module names of the linears `attach` adapts, in model order."""
    layers = decoder_layers(model)
    prefix = "model.layers."
    names = []
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and ADAPTED.search(name):
                names.append(f"{prefix}{i}.{name}")
    return names


def attach(model: nn.Module, rank: int = 16, alpha: float | None = None, seed: int = 0) -> list[str]:
    """Freeze `model` and wrap its adapted linears in `LoRA` (rank `rank`, scale alpha/rank, alpha
    defaulting to rank); returns the wrapped names. Mutates `model`. Raises ValueError when the
    model has no linear to adapt or `rank` is not positive."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    names = adapted_names(model)
    if not names:
        raise ValueError(f"{type(model).__name__}: no attention or mixer projection to adapt")
    for k, name in enumerate(names):
        parent, attr = name.rsplit(".", 1)
        owner = model.get_submodule(parent)
        setattr(owner, attr, LoRA(getattr(owner, attr), rank, float(alpha if alpha is not None else rank), seed * 100_003 + k))
    return names


def modules(model: nn.Module) -> dict[str, LoRA]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRA)}


def parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable factors, in a fixed order (the optimiser's)."""
    return [p for m in modules(model).values() for p in (m.down, m.up)]


def factors(model: nn.Module) -> dict[str, torch.Tensor]:
    """`{"<linear>.lora_down": ..., "<linear>.lora_up": ...}` (detached copies), scale folded into up."""
    out = {}
    for name, m in modules(model).items():
        out[f"{name}.lora_down"] = m.down.detach().clone()
        out[f"{name}.lora_up"] = (m.up.detach() * m.scale).clone()
    return out


def load_factors(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the attached adapters from `factors` output. Raises ValueError on a missing or misshaped factor."""
    with torch.no_grad():
        for name, m in modules(model).items():
            down, up = state.get(f"{name}.lora_down"), state.get(f"{name}.lora_up")
            if down is None or up is None:
                raise ValueError(f"adapter state has no factors for {name}")
            if down.shape != m.down.shape or up.shape != m.up.shape:
                raise ValueError(f"{name}: factors {tuple(down.shape)}/{tuple(up.shape)}, the model's {tuple(m.down.shape)}/{tuple(m.up.shape)}")
            m.down.copy_(down.to(m.down.dtype))
            m.up.copy_((up.float() / m.scale).to(m.up.dtype))


def detach(model: nn.Module) -> None:
    """Replace every LoRA by its merged plain linear (mutates `model`): the exported model."""
    for name, m in list(modules(model).items()):
        parent, attr = name.rsplit(".", 1)
        base = m.base
        with torch.no_grad():
            base.weight.add_(m.delta().to(base.weight.dtype))
        setattr(model.get_submodule(parent), attr, base)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every correction merged into its linear's weight, under the
    names of the model without adapters."""
    sd = {}
    lora = modules(model)
    for key, value in model.state_dict().items():
        if ".lora" in key or key.endswith((".down", ".up")) and key.rsplit(".", 1)[0] in lora:
            continue
        sd[key.replace(".base.", ".")] = value
    for name, m in lora.items():
        sd[f"{name}.weight"] = (m.base.weight + m.delta()).detach()
    return sd


class disabled:
    """Context manager: the model's adapters contribute nothing inside it (the base model: the
    frozen teacher of a self-distillation), restored on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.mods = list(modules(model).values())

    def __enter__(self):
        self.scales = [m.scale for m in self.mods]
        for m in self.mods:
            m.scale = 0.0
        return self

    def __exit__(self, *exc) -> None:
        for m, s in zip(self.mods, self.scales):
            m.scale = s


class LoRATuning:
    """The trainer's view of LoRA (training/reuse/full.py `FullTuning` is the other): attaches the
    adapters to `model` (mutates it) and gives the trainable parameters, the checkpoint state, the
    exported tensors and the adapters-off context."""

    def __init__(self, model: nn.Module, rank: int, seed: int = 0) -> None:
        self.model = model
        attach(model, rank, seed=seed)

    def parameters(self) -> list[nn.Parameter]:
        return parameters(self.model)

    def state(self) -> dict[str, torch.Tensor]:
        return factors(self.model)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        load_factors(self.model, state)

    def exported(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16).contiguous() for k, v in factors(self.model).items()}

    def disabled(self) -> disabled:
        return disabled(self.model)
