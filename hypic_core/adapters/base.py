"""What the engine needs to know about a model family, behind one small interface.

An adapter answers, for one loaded transformers model:
- which decoder layers are full attention and which are linear (recurrent) layers;
- how to capture, during a plain forward, the per-token quantities a linear layer's
  recurrence consumes, and turn a span of them into a `LinearOperator` (T, E);
- how to read and write a linear layer's conv and recurrent state in a transformers cache;
- whether attention keys carry a position; moving them is `rotary.KeyRotation`'s (RoPE
  re-rotation; NoPE: nothing).

Adding a family means adding one file with one `ModelAdapter` subclass and registering it.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch

from ..algebra.operators import LinearOperator
from .kernels import KernelSelection, patched
from .rotary import KeyRotation


@dataclass
class Capture:
    """What every linear layer saw during one captured forward, in layer order.

    `start` is the segment position of the forward's first token and `seq_len` its (padded)
    length. `conv_inputs[i]` is layer i's pre-conv input [B, C, X]: the forward's tokens are
    its last `seq_len` columns, preceded by whatever conv state the layer already held.
    `scan_args[i]` are the arguments its recurrence kernel received (reference path);
    `operators[i]` is (T, E) batched over rows, computed inside the kernel call (fused path).
    `keep_graph`: record the inputs with their autograd graph (entries a loss can train through:
    training/hybrid/distill.py); by default they are detached, as serving wants.
    """

    start: int = 0
    seq_len: int = 0
    keep_graph: bool = False
    conv_inputs: list[torch.Tensor] = field(default_factory=list)
    scan_args: list[dict[str, Any]] = field(default_factory=list)
    operators: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as recorded: detached unless `keep_graph`."""
        return t if self.keep_graph else t.detach()


class ModelAdapter(ABC):
    """Family-specific knowledge about one loaded model. Stateless apart from the model handle."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    # The modeling module's ops transformers may bind to a package kernel (fla, causal_conv1d,
    # mamba_ssm); families with linear layers set `kernels` from these in __init__ (adapters/kernels.py).
    kernel_ops: ClassVar[tuple[str, ...]] = ()
    kernels: KernelSelection = KernelSelection(None)
    # The extra work a canonical entry's linear layers cost per token (its body operators T, E beside
    # the forward), per element of the linear state, in units of one parameter of the forward's
    # per-token weights: the cost model of hypic_core/engine/plan.py (`CostModel`) multiplies it by the
    # state's elements and divides by the per-token parameters. Fitted per family on the bench-size
    # models of bench/families.py (docs/benchmarks.md, "Cold"); 0: no transition work to speak of.
    entry_state_cost: ClassVar[float] = 0.0

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config
        self.attention_layers: list[int] = []
        self.linear_layers: list[int] = []
        self._classify_layers()
        self.rotation = KeyRotation.of(model, self.uses_nope)

    # --- layers -------------------------------------------------------------------------
    def _classify_layers(self) -> None:
        """Fill `attention_layers` and `linear_layers` (decoder layer indices, ascending).

        Default: the config's `layer_types`, where "linear_attention" marks a linear layer and
        anything else a full-attention one (Gated DeltaNet, KDA, lightning).
        """
        for i, kind in enumerate(self.config.layer_types[: self.num_layers]):
            (self.linear_layers if kind == "linear_attention" else self.attention_layers).append(i)

    def kernel_plan(self, device: torch.device | str | None = None) -> dict[int, dict[str, str]]:
        """What each linear layer's ops run on `device` (default: the model's) in a plain forward, by layer index.

        Values are "torch" or the package ("fla", "causal_conv1d", "mamba_ssm"); capture, fused
        capture and stitch forwards always run "torch". An empty dict per layer: nothing to choose.
        """
        plan = self.kernels.plan(self.model.device if device is None else device)
        return {i: dict(plan) for i in self.linear_layers}

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0) or 1 << 20

    def new_cache(self):
        """An empty transformers cache for one sequence of this model (families with their own cache class override)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    # --- linear layers ------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, start: int = 0, seq_len: int = 0, keep_graph: bool = False) -> Iterator[Capture]:
        """Record every linear layer's per-token inputs during the forward run inside (reference path).

        The patches hold for the block and the calling thread only (`_patched`). `keep_graph`: see `Capture`.
        """
        with self._patched(Capture(start, seq_len, keep_graph), self._capture_patches) as cap:
            yield cap

    # Fused path: a family that can compute its body operators inside the forward's own kernel
    # call sets this and implements `_fused_patches` and `fused_operators`.
    supports_fused_body = False

    @contextlib.contextmanager
    def capture_body(self, seam: int, body_lengths: list[int], seq_len: int, start: int = 0) -> Iterator[Capture]:
        """Compute every linear layer's body (T, E) during the canonical forward run inside.

        The forward runs segments (or, from `start`, the next piece of one segment on its own
        cache: `ModelRunner.advance_entry`); its tokens [0, seam) are (what is left of) the seam
        heads, and row r's body is the next `body_lengths[r]` tokens (the rest is padding, which
        must not touch the state).
        """
        cap = Capture(start, seq_len)
        with self._patched(cap, lambda c: self._fused_patches(c, seam, body_lengths)) as cap:
            yield cap

    def _fused_patches(self, cap: Capture, seam: int, body_lengths: list[int]) -> dict[tuple[Any, str], Callable]:
        raise NotImplementedError(f"{self.family} has no fused body path")

    def fused_operators(self, cap: Capture, row: int) -> list[LinearOperator]:
        """Row `row`'s body operators recorded by `capture_body`, one per linear layer."""
        return [LinearOperator(T[row].float(), E[row].float()) for T, E in cap.operators]

    # Fused stitch: every seam head and the question in ONE forward. Attention sees the cached
    # bodies through a position mask; linear layers advance S <- T S + E between spans inside
    # their own kernel call. Families that set this implement `_stitch_patches`.
    supports_fused_stitch = False

    @contextlib.contextmanager
    def stitch(self, spans: list[StitchSpan], transition: bool = True) -> Iterator[Capture]:
        """Patch the linear layers for one fused stitch forward over `spans` (run-token ranges, in order).

        After the forward, `finish_stitch` writes each layer's true final conv state.
        """
        with self._patched(Capture(), lambda c: self._stitch_patches(c, spans, transition)) as cap:
            yield cap

    def _stitch_patches(self, cap: Capture, spans: list[StitchSpan], transition: bool) -> dict[tuple[Any, str], Callable]:
        return {}

    def finish_stitch(self, cache, cap: Capture) -> None:
        """Copy the conv contexts recorded during a fused stitch into the cache (row 0)."""
        for p, ctx in enumerate(cap.conv_inputs):
            cache.layers[self.linear_layers[p]].conv_states[0][0].copy_(ctx)

    def mask_argument(self, mask: torch.Tensor):
        """What the model's forward takes as `attention_mask` for a prepared 4D mask [1, 1, Q, K] (bool, True = attend)."""
        if getattr(self.config, "_attn_implementation", "sdpa") == "eager":
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min)
        if self.linear_layers:  # hybrids build one mask per layer type; linear layers take none (no padding)
            return {"full_attention": mask, "linear_attention": None}
        return mask

    @contextlib.contextmanager
    def _patched(self, cap: Capture, make_patches) -> Iterator[Capture]:
        """Apply `make_patches(cap)` for the block, every other kernel op pinned to its torch fallback.

        On the calling thread only (`kernels.patched`): the patched attributes are dispatchers that
        each thread resolves for itself, so forwards on other threads, of this model or another one
        of the family, neither see these wrappers nor leave theirs behind.
        """
        with patched({**self.kernels.torch_patches(), **make_patches(cap)}):
            yield cap

    def _capture_patches(self, cap: Capture) -> dict[tuple[Any, str], Callable]:
        """Map (module, function name) -> wrapper that records into `cap` and calls the original."""
        return {}

    def span_operators(self, cap: Capture, row: int, start: int, end: int) -> list[LinearOperator]:
        """(T, E) of tokens [start, end) of batch row `row`, for every linear layer, in fp32."""
        raise NotImplementedError(f"{self.family} has no linear layers")

    def conv_tail(self, cap: Capture, layer_pos: int, row: int, end: int) -> torch.Tensor:
        """Pre-conv inputs of the segment's last (up to K) tokens before position `end`: [C, min(end, K)].

        Token t sits at column X - seq_len + (t - start) of the captured conv input; the
        columns before the forward's own tokens hold the conv state it started from (the seam
        head's last inputs on the fused path), so tails reaching into the head are exact.
        """
        x = cap.conv_inputs[layer_pos][row]
        col = lambda t: x.shape[-1] - cap.seq_len + (t - cap.start)  # noqa: E731
        return x[:, col(max(0, end - self.conv_kernel(layer_pos))) : col(end)].clone()

    # Families keep their linear layers' mixer modules here; the defaults below read the
    # attribute names the transformers mixers share (conv_kernel_size, conv_dim, A_log, dt_bias).
    _mixers: list[torch.nn.Module] = []

    def conv_kernel(self, layer_pos: int) -> int:
        return int(self._mixers[layer_pos].conv_kernel_size)

    def conv_shape(self, layer_pos: int) -> tuple[int, int]:
        m = self._mixers[layer_pos]
        return (int(m.conv_dim), int(m.conv_kernel_size))

    def state_shape(self, layer_pos: int) -> tuple[int, ...]:
        """Shape of one sequence's recurrent state in linear layer `layer_pos`."""
        raise NotImplementedError

    def decay_parameters(self, layer_pos: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """(A_log, dt_bias) of a linear layer: what tests set to make heads decay slowly."""
        m = self._mixers[layer_pos]
        return m.A_log, m.dt_bias

    def linear_state_or_zero(self, cache, layer_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [C, K], recurrent state) of batch row 0. Mutates a fresh layer: installs zero states first."""
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

    def linear_rows(self, cache, layer_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, C, K], recurrent state [B, ...]) of every row of linear layer `layer_pos` (views)."""
        layer = cache.layers[self.linear_layers[layer_pos]]
        return layer.conv_states[0], layer.recurrent_states[0]

    def bind_linear_rows(self, cache, layer_pos: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Point linear layer `layer_pos` of `cache` at `conv` [B, C, K] and `state` [B, ...] (the decode
        batch's row buffers, not copied), which the forward then updates in place."""
        layer = cache.layers[self.linear_layers[layer_pos]]
        if not layer.has_previous_state[0]:  # a fresh cache: set the layer up empty (no copy), then point it
            layer.lazy_initialization(conv_states=conv[:0], conv_kernel_size=conv.shape[-1])
            layer.lazy_initialization(recurrent_states=state[:0])
            layer.has_previous_state[0] = True
        layer.conv_states[0], layer.recurrent_states[0] = conv, state

    # Batched decode: all running sequences advance in one forward, each a row of the decode
    # batch's preallocated slots (hypic_core/batch.py). Families whose forward cannot take that
    # set this False and decode one sequence per forward.
    supports_batched_decode = True

    # --- attention layers: key rotation lives in adapters/rotary.py -----------------------
    @property
    def uses_nope(self) -> bool:
        """True when attention layers use no positional rotation (keys are position-free).

        By default: the model has no rotary embedding module (OLMo-hybrid, Granite, Nemotron).
        """
        return getattr(self.model.base_model, "rotary_emb", None) is None

    @property
    def rotary_dim(self) -> int:
        return self.rotation.dim

    def rotate_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Move keys rotated at positions p to positions p + delta (`KeyRotation.move`)."""
        return self.rotation.move(keys, delta)

    def key_mover(self, deltas: torch.Tensor):
        """f(keys) moving column i of keys [..., L, D] by deltas[i] (`KeyRotation.mover`)."""
        return self.rotation.mover(deltas)

    def rope_at(self, keys_unrotated: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reference: position-free keys rotated at absolute `positions` (`KeyRotation.at`)."""
        return self.rotation.at(keys_unrotated, positions)


@dataclass(frozen=True)
class StitchSpan:
    """Run tokens [start, end) of a fused stitch, then the cached body of `entry` (None: nothing follows)."""

    start: int
    end: int
    entry: Any = None  # SegmentEntry with a non-empty body


def span_chunk(n: int, limit: int = 64) -> int:
    """Kernel chunk size for a span of n tokens: short spans (seam heads) run as one small chunk
    instead of being padded to the kernel's default (at most `limit`)."""
    return min(limit, 1 << max(3, (n - 1).bit_length()))


def require(condition: bool, model_type: str, why: str) -> None:
    """Raise UnsupportedArchitectureError naming the model type unless `condition` holds."""
    from ..errors import UnsupportedArchitectureError

    if not condition:
        raise UnsupportedArchitectureError(f"model type {model_type!r} is not supported: {why}")
