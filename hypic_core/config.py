"""Frozen, validated configuration objects of the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import InvalidRequestError

DEFAULT_SEAM = 8  # the reference implementation's default seam width


class Mode(str, enum.Enum):
    """How a request's context segments are prefilled (DESIGN section 5)."""

    FULL = "full"  # no cache: one forward over the whole prompt
    PREFIX = "prefix"  # exact prefix reuse only
    PIC_NAIVE = "pic-naive"  # K/V reuse, linear states summed (transitions ignored)
    HYPIC = "hypic"  # K/V reuse + linear-state composition + seam recompute

    @classmethod
    def parse(cls, value: "str | Mode") -> "Mode":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise InvalidRequestError("mode", f"unknown mode {value!r}; expected one of {choices}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters. temperature == 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 5.0:
            raise InvalidRequestError("temperature", f"must be in [0, 5], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0, got {self.top_k!r}")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs", f"must be in [0, 20], got {self.top_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    memory_budget_bytes bounds the in-memory segment store; prefix_budget_bytes bounds the
    snapshots kept for `prefix` mode.
    """

    seam: int = DEFAULT_SEAM
    default_mode: Mode = Mode.HYPIC
    memory_budget_bytes: int = 2 << 30
    prefix_budget_bytes: int = 512 << 20
    max_cold_batch_tokens: int = 16384
    model_id: str = "model"

    def __post_init__(self) -> None:
        if self.seam < 0:
            raise InvalidRequestError("seam", f"must be >= 0, got {self.seam}")
        if self.memory_budget_bytes < 0 or self.prefix_budget_bytes < 0:
            raise InvalidRequestError("memory_budget_bytes", "budgets must be >= 0")
        if self.max_cold_batch_tokens < 1:
            raise InvalidRequestError("max_cold_batch_tokens", "must be >= 1")
        object.__setattr__(self, "default_mode", Mode.parse(self.default_mode))


@dataclass(frozen=True)
class GenerationRequest:
    """One request: token-id segments (context segments then the question, last) and how to run them.

    The last segment is always the question and is computed in full; the others are cached.
    """

    segments: tuple[tuple[int, ...], ...]
    mode: Mode = Mode.HYPIC
    seam: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.segments:
            raise InvalidRequestError("segments", "a request needs at least one segment (the question)")
        segs = []
        for i, seg in enumerate(self.segments):
            seg = tuple(int(t) for t in seg)
            if not seg:
                raise InvalidRequestError(f"segments[{i}]", "segment is empty")
            segs.append(seg)
        object.__setattr__(self, "segments", tuple(segs))
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.seam is not None and self.seam < 0:
            raise InvalidRequestError("seam", f"must be >= 0, got {self.seam}")

    @property
    def context(self) -> tuple[tuple[int, ...], ...]:
        return self.segments[:-1]

    @property
    def question(self) -> tuple[int, ...]:
        return self.segments[-1]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)
