"""What the engine needs to know about a model family, behind one small interface.

An adapter answers, for one loaded transformers model:
- which decoder layers are full attention and which are linear (recurrent) layers;
- how to capture, during a plain forward, the per-token quantities a linear layer's
  recurrence consumes, and turn a span of them into a `LinearOperator` (T, E);
- how to read and write a linear layer's conv and recurrent state in a transformers cache;
- how to move cached attention keys to a new position (RoPE re-rotation; NoPE: nothing).

Adding a family means adding one file with one `ModelAdapter` subclass and registering it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch

from ..operators import LinearOperator


@dataclass
class Capture:
    """Per-token inputs of every linear layer, recorded during one forward, in layer order.

    `conv_inputs[i]` is layer i's pre-conv projection [B, C, L] (what its conv state keeps);
    `scan_args[i]` are the keyword arguments its recurrence kernel received.
    """

    conv_inputs: list[torch.Tensor] = field(default_factory=list)
    scan_args: list[dict[str, Any]] = field(default_factory=list)


class ModelAdapter(ABC):
    """Family-specific knowledge about one loaded model. Stateless apart from the model handle."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config
        self.attention_layers: list[int] = []
        self.linear_layers: list[int] = []
        self._classify_layers()
        self._inv_freq, self._rope_scaling = self._find_rotary()

    # --- layers -------------------------------------------------------------------------
    @abstractmethod
    def _classify_layers(self) -> None:
        """Fill `attention_layers` and `linear_layers` (decoder layer indices, ascending)."""

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0) or 1 << 20

    # --- linear layers ------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[Capture]:
        """Record every linear layer's per-token inputs during the forward passes run inside.

        The engine runs one model at a time on its worker thread; the patch is process-wide
        for the duration of the block.
        """
        cap = Capture()
        patches = self._capture_patches(cap)
        saved = {}
        try:
            for (module, name), wrapper in patches.items():
                saved[(module, name)] = getattr(module, name)
                setattr(module, name, wrapper)
            yield cap
        finally:
            for (module, name), original in saved.items():
                setattr(module, name, original)

    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        """Map (module, function name) -> wrapper that records into `cap` and calls the original."""
        return {}

    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        """(T, E) of tokens [start, end) of batch row `row`, for every linear layer, in fp32."""
        raise NotImplementedError(f"{self.family} has no linear layers")

    def conv_tail(self, cap: Capture, layer_pos: int, row: int, end: int) -> torch.Tensor:
        """Pre-conv inputs of the last (up to K) tokens before `end`: [C, min(end, K)]."""
        x = cap.conv_inputs[layer_pos][row]
        return x[:, max(0, end - self.conv_kernel(layer_pos)) : end].clone()

    def conv_kernel(self, layer_pos: int) -> int:
        raise NotImplementedError

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        """Shape of one sequence's recurrent state in linear layer `layer_pos`."""
        raise NotImplementedError

    def conv_shape(self, layer_pos: int) -> tuple[int, int]:
        raise NotImplementedError

    def read_linear_state(self, cache, layer_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [C, K], recurrent state) of batch row 0; zeros (and initialised) if the layer is fresh."""
        idx = self.linear_layers[layer_pos]
        layer = cache.layers[idx]
        if not layer.has_previous_state[0]:
            dtype = self.model.dtype
            conv = torch.zeros((1, *self.conv_shape(layer_pos)), dtype=dtype, device=self.model.device)
            cache.update_conv_state(conv, idx, conv_kernel_size=self.conv_kernel(layer_pos))
            state = torch.zeros((1, *self.state_shape(layer_pos)), dtype=torch.float32, device=self.model.device)
            cache.update_recurrent_state(state, idx)
        return layer.conv_states[0][0], layer.recurrent_states[0][0]

    def write_linear_state(self, cache, layer_pos: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Copy `conv` and `state` into the cache buffers of linear layer `layer_pos` (row 0)."""
        layer = cache.layers[self.linear_layers[layer_pos]]
        layer.conv_states[0][0].copy_(conv)
        layer.recurrent_states[0][0].copy_(state)

    # --- attention layers ---------------------------------------------------------------
    def _find_rotary(self) -> tuple[torch.Tensor | None, float]:
        rotary = getattr(self.model.base_model, "rotary_emb", None)
        if rotary is None or self.uses_nope:
            return None, 1.0
        return rotary.inv_freq.detach().to(torch.float64).cpu(), float(getattr(rotary, "attention_scaling", 1.0))

    @property
    def uses_nope(self) -> bool:
        """True when attention layers use no positional rotation (keys are position-free)."""
        return False

    @property
    def rotary_dim(self) -> int:
        return 0 if self._inv_freq is None else 2 * self._inv_freq.numel()

    def rotate_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Move keys rotated at positions p to positions p + delta. keys: [..., L, head_dim].

        RoPE rotations compose (R(p + d) = R(d) R(p)), so this rotates every key by `delta`
        on the rotary dims (the first `rotary_dim`; partial rotary leaves the rest) using the
        rotate-half layout of transformers' `apply_rotary_pos_emb`. NoPE: returned unchanged.
        """
        if self._inv_freq is None or delta == 0:
            return keys
        angles = float(delta) * self._inv_freq  # float64 for large offsets
        cos = torch.cat([angles.cos(), angles.cos()]).to(keys.device, torch.float32)
        sin = torch.cat([angles.sin(), angles.sin()]).to(keys.device, torch.float32)
        d = self.rotary_dim
        rot = keys[..., :d].to(torch.float32)
        half = d // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = keys.clone()
        out[..., :d] = (rot * cos + rotated_half * sin).to(keys.dtype)
        return out

    def rope_at(self, keys_unrotated: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reference: rotate position-free keys [..., L, D] at absolute `positions` [L] (tests)."""
        if self._inv_freq is None:
            return keys_unrotated
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.float32) * self._rope_scaling
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.float32) * self._rope_scaling
        d = self.rotary_dim
        rot = keys_unrotated[..., :d].to(torch.float32)
        half = d // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = keys_unrotated.clone()
        out[..., :d] = (rot * cos + rotated_half * sin).to(keys_unrotated.dtype)
        return out


def require(condition: bool, model_type: str, why: str) -> None:
    """Raise UnsupportedArchitectureError naming the model type unless `condition` holds."""
    from ..errors import UnsupportedArchitectureError

    if not condition:
        raise UnsupportedArchitectureError(f"model type {model_type!r} is not supported: {why}")
