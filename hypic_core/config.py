"""Frozen, validated configuration objects of the engine core."""

from __future__ import annotations

import enum
import math
import reprlib
from dataclasses import dataclass, field

from .errors import InvalidRequestError

DEFAULT_SEAM = 8  # the reference implementation's default seam width
COLD_PREFILL = ("stitch", "exact", "auto")  # EngineConfig.cold_prefill
REPEATS = ("exact", "cheaper")  # EngineConfig.repeats
ENTRY_BATCHING = ("padded", "alone")  # EngineConfig.entry_batching
DECODE_STEPS = ("module", "lean")  # EngineConfig.decode_step ("lean-packed" was measured and removed: docs/benchmarks.md)
DECODE_KERNELS = ("torch", "native", "native-f16", "native-bf16", "native-i8", "native-q8")  # EngineConfig.decode_kernel
REUSE_KEY_SCOPES = ("prompt", "all")  # EngineConfig.reuse_key_scope
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [-2**63, 2**64); negative seeds alias positive ones


class Mode(str, enum.Enum):
    """How a request's context segments are prefilled (the README's "Modes")."""

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
            raise InvalidRequestError("mode", f"unknown mode {reprlib.repr(value)}; expected one of {choices}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters. temperature == 0 means greedy.

    top_k == 0 disables top-k. The vLLM-compatible extras: `min_p` drops tokens whose probability
    is below min_p times the most likely token's (0 = off); `repetition_penalty` divides the
    positive logits and multiplies the negative logits of every token already in the prompt or
    the output (1 = off); `min_tokens` forbids EOS until that many tokens are generated;
    `ignore_eos` never stops at EOS (generation ends on max_tokens, a stop string or the
    context's end). The engine enforces the last two by passing EOS ids as `banned` to the
    `Sampler`.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

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
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError("seed", "must be an integer in [0, 2**64 - 1]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    memory_budget_bytes bounds the in-memory segment store (when the engine builds it);
    exact_budget_bytes bounds the exact snapshots of leading segment runs (hypic_core/cache/exact_runs.py);
    max_running, max_step_tokens and running_budget_bytes bound the scheduler (hypic_core/engine/scheduler.py).
    exact_repeats (pic modes): past `GenerationRequest.exact_prefix`, restore the longest run of
    leading context segments an exact snapshot holds (a `prefix`-mode request's context, an earlier
    repeat), and compute exactly (in context) and snapshot a run an earlier request had in the same
    order, so a repeat equals full prefill there from its second sighting on. The gateway turns it
    on; off (the default here), only the exact prefix is exact and the same request always gets the
    same answer whatever the cache holds, as benchmarks comparing modes on one engine need.
    repeats (with exact_repeats): what a run seen before in this order, that no snapshot holds yet,
    costs. "exact" (the default): computed exactly at its second sighting and snapshotted, so a
    repeat equals full from then on, even where composing it from stored entries is cheaper.
    "cheaper": computed exactly only when the cost model (`CostModel`) puts its forward at no more
    than composing it; otherwise composed (no snapshot), so no repeat pays a forward it could skip.
    cold_prefill (pic modes, requests with `exact_runs`): how a request whose context entries are
    missing is prefilled. "stitch" (the default here): canonical entries of the misses, then the
    stitch. "exact": a request that misses every entry it would stitch runs ONE exact forward over
    the prompt, as `full` does (its answer is `full`'s), and the missing entries are computed
    after its first token, off the critical path (`background_tokens`). "auto": the exact forward
    whenever the cost model (hypic_core/engine/plan.py `CostModel`) says the cold entries and the stitch
    cost more than it. The gateway defaults to "auto" (`HYPIC_COLD_PREFILL`); off here for the same
    reason as exact_repeats (the answer would depend on what the cache holds).
    background_tokens bounds the tokens of deferred cold work queued (the oldest is dropped past it).
    entry_prefix (pic modes): every canonical entry is computed as its segment would sit after these
    tokens (the prompt's fixed head), keeping only the segment's own K/V and body operators (T, E from
    a zero state); a stitched request's first context segment is then computed exactly (it sits after
    nothing). seam_fraction widens each segment's seam head to a share of its length (`head_width`).
    recompute_ratio (pic modes; a request's `recompute` overrides): a budget of that share of the tokens
    the seam heads leave reused, spent widening the heads of the segments nearest the question, each up
    to its whole length (hypic_core/engine/recompute.py); 0: every segment keeps its head, 1: every
    segment is computed in context (`full`'s prefill).
    """

    seam: int = DEFAULT_SEAM
    memory_budget_bytes: int = 2 << 30
    exact_budget_bytes: int = 512 << 20
    max_cold_batch_tokens: int = 16384
    max_running: int = 8  # sequences prefilling or decoding at once (one batched decode forward)
    max_step_tokens: int = 512  # model tokens per engine step: decode tokens + a chunk of prefill
    running_budget_bytes: int = 4 << 30  # attention K/V + linear state of the running sequences
    exact_repeats: bool = False
    repeats: str = "exact"  # "exact" or "cheaper" (see above)
    scheduling: str = "fcfs"  # the waiting queue's policy: "fcfs" or "priority" (hypic_core/engine/request_queue.py)
    cold_prefill: str = "stitch"  # "stitch", "exact" or "auto" (see above)
    background_tokens: int = 1 << 20  # deferred cold work queued at most, in segment tokens
    # With a store that reads disk or Redis: the longest an arriving request waits for its stored-tier lookups
    # (hypic_core/engine/lookups.py); what has not returned by then is computed, and used from the next request.
    lookup_deadline_s: float = 1.0
    # Whole cold entries computed "padded" (misses batched together: fastest) or "alone" (one forward each: the
    # cache's bytes, and so greedy answers, do not depend on which segments missed together; engine/entry_builder.py).
    entry_batching: str = "padded"
    # The batched decode forward: "lean" (hypic_core/runner/decode_step.py: fused weights, closed-form
    # one-token updates; a family it does not cover keeps the module path) or "module" (the HF modules).
    decode_step: str = "module"
    # The lean step's matmuls: "torch" (torch's kernels), "native" (hypic_core/native/decode_matmul.py: the
    # CPU's best ISA variant of the native kernels, on the fp32 weights; torch's when they cannot be had),
    # "native-f16" / "native-bf16" (the same on an fp16 / bf16 copy of the weights: half the bytes, lossy) or
    # "native-i8" / "native-q8" (on an int8 copy with one scale per row / per 32 weights of a row: a quarter
    # of the bytes, lossier).
    decode_kernel: str = "torch"
    # Canonical entries computed after this fixed head (token ids: BOS and the chat template's system
    # part), whose own K/V and state are then dropped; part of every entry key. () : computed alone.
    entry_prefix: tuple[int, ...] = ()
    # A segment's seam head is max(seam, ceil(seam_fraction * its length)) tokens (at most all of it).
    seam_fraction: float = 0.0
    # Query-aware recompute budget (see above): 0.0 off.
    recompute_ratio: float = 0.0
    # Stitched bodies' keys are multiplied by this (a temperature of 1 / reuse_key_scale on every later
    # query's logits over reused tokens, as APE does for parallel-encoded context); 1.0: as computed.
    reuse_key_scale: float = 1.0
    # Which tokens read the scaled keys: "prompt" (the stitch and the rest of the prompt; the keys are set
    # back to 1x before the first answer token, so the answer reads them as computed) or "all".
    reuse_key_scope: str = "prompt"
    # Speculative decoding (hypic_core/engine/drafting.py, runner/verify_step.py): prompt-lookup drafts of up
    # to `speculation_max_draft` tokens from n-grams of up to `speculation_ngram` tokens, verified in the
    # decode forward. Runs where the lean decode step runs; a request's `speculation` overrides.
    speculation: bool = True
    speculation_max_draft: int = 8
    speculation_ngram: int = 3
    speculation_min_ngram: int = 2  # a single repeated token is weak evidence: drafts need a longer match
    # What one more token in the verification forward costs, in plain decode steps, until the engine has
    # measured it (drafting.py DraftCost): drafts are only as long as the acceptance seen so far pays for.
    speculation_cost: float = 0.3

    def __post_init__(self) -> None:
        if self.seam < 0:
            raise InvalidRequestError("seam", f"must be >= 0, got {self.seam}")
        if self.memory_budget_bytes < 0 or self.exact_budget_bytes < 0:
            raise InvalidRequestError("memory_budget_bytes", "budgets must be >= 0")
        for name in ("max_cold_batch_tokens", "max_running", "max_step_tokens", "running_budget_bytes"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.scheduling not in ("fcfs", "priority"):
            raise InvalidRequestError("scheduling", f"must be 'fcfs' or 'priority', got {self.scheduling!r}")
        if self.cold_prefill not in COLD_PREFILL:
            raise InvalidRequestError("cold_prefill", f"must be one of {', '.join(COLD_PREFILL)}, got {self.cold_prefill!r}")
        if self.repeats not in REPEATS:
            raise InvalidRequestError("repeats", f"must be one of {', '.join(REPEATS)}, got {self.repeats!r}")
        if self.background_tokens < 0:
            raise InvalidRequestError("background_tokens", f"must be >= 0, got {self.background_tokens}")
        if not self.lookup_deadline_s > 0:
            raise InvalidRequestError("lookup_deadline_s", f"must be > 0, got {self.lookup_deadline_s}")
        if self.entry_batching not in ENTRY_BATCHING:
            raise InvalidRequestError("entry_batching", f"must be one of {', '.join(ENTRY_BATCHING)}, got {self.entry_batching!r}")
        if self.decode_step not in DECODE_STEPS:
            gone = " (lean-packed was removed: measured, not kept, docs/benchmarks.md; lean replaces it)" \
                if self.decode_step == "lean-packed" else ""
            raise InvalidRequestError("decode_step", f"must be one of {', '.join(DECODE_STEPS)}, got {self.decode_step!r}{gone}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise InvalidRequestError("decode_kernel", f"must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        object.__setattr__(self, "entry_prefix", tuple(int(t) for t in self.entry_prefix))
        if not 0.0 <= self.speculation_cost <= 10.0:
            raise InvalidRequestError("speculation_cost", f"must be in [0, 10], got {self.speculation_cost!r}")
        for name in ("speculation_max_draft", "speculation_ngram", "speculation_min_ngram"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidRequestError(name, f"must be an integer >= 1, got {getattr(self, name)!r}")
        if self.speculation_min_ngram > self.speculation_ngram:
            raise InvalidRequestError("speculation_min_ngram", f"must be <= speculation_ngram ({self.speculation_ngram}), "
                                      f"got {self.speculation_min_ngram}")
        if not 0.0 <= self.seam_fraction <= 1.0:  # NaN fails too
            raise InvalidRequestError("seam_fraction", f"must be in [0, 1], got {self.seam_fraction!r}")
        if not 0.0 <= self.recompute_ratio <= 1.0:  # NaN fails too
            raise InvalidRequestError("recompute_ratio", f"must be in [0, 1], got {self.recompute_ratio!r}")
        if self.reuse_key_scope not in REUSE_KEY_SCOPES:
            raise InvalidRequestError("reuse_key_scope", f"must be one of {', '.join(REUSE_KEY_SCOPES)}, got {self.reuse_key_scope!r}")
        if not 0.25 <= self.reuse_key_scale <= 4.0:  # NaN fails too
            raise InvalidRequestError("reuse_key_scale", f"must be in [0.25, 4], got {self.reuse_key_scale!r}")

    def head_width(self, seam: int, length: int) -> int:
        """The seam width a segment of `length` tokens gets under the fixed width `seam` and `seam_fraction`:
        max(seam, ceil(seam_fraction * length)); the head recomputed is at most the segment (min with length)."""
        return max(seam, math.ceil(self.seam_fraction * length))


@dataclass(frozen=True)
class GenerationRequest:
    """One request: token-id segments (context segments then the question, last) and how to run them.

    The last segment is always the question and is computed in full; the others are cached.
    """

    segments: tuple[tuple[int, ...], ...]
    mode: Mode = Mode.HYPIC
    seam: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # hypic / pic-naive: the first `exact_prefix` context segments (system prompt, earlier turns)
    # are computed exactly, or restored from an exact snapshot; only the ones after are stitched.
    exact_prefix: int = 0
    # pic modes with EngineConfig.exact_repeats: reuse (and make) exact snapshots of longer leading
    # runs than `exact_prefix`. False: segments after `exact_prefix` always compose (the accuracy
    # guard measures composition with it).
    exact_runs: bool = True
    priority: int = 0  # with EngineConfig.scheduling "priority": lower is admitted first
    keep_logits: bool = False  # the first output carries the first-token logits (the accuracy guard compares them)
    # A namespace in every cache key the request builds (segment entries, exact snapshots and their
    # sightings), so that what one salt computed never serves another: the gateway's tenant, set
    # server-side, never from the request. "" : the unsalted keys.
    cache_salt: str = ""
    # False: compute and answer, keep nothing (no entry, snapshot, sighting or deferred work stored);
    # lookups still read the cache.
    cache_store: bool = True
    # Speculative decoding for this request: None follows EngineConfig.speculation.
    speculation: bool | None = None
    # pic modes: the query-aware recompute budget (EngineConfig.recompute_ratio), in [0, 1]; None follows it.
    recompute: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cache_salt, str):
            raise InvalidRequestError("cache_salt", f"must be a string, got {type(self.cache_salt).__name__}")
        if not isinstance(self.cache_store, bool):
            raise InvalidRequestError("cache_store", f"must be a boolean, got {self.cache_store!r}")
        if self.speculation is not None and not isinstance(self.speculation, bool):
            raise InvalidRequestError("speculation", f"must be a boolean or null, got {self.speculation!r}")
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
        if self.recompute is not None and (isinstance(self.recompute, bool) or not isinstance(self.recompute, (int, float))
                                           or not 0.0 <= self.recompute <= 1.0):  # NaN fails too
            raise InvalidRequestError("recompute", f"must be a number in [0, 1] or null, got {self.recompute!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError("priority", f"must be an integer, got {self.priority!r}")
        if not 0 <= self.exact_prefix <= len(self.segments) - 1:
            raise InvalidRequestError("exact_prefix", f"must be in [0, {len(self.segments) - 1}] (the context segments), "
                                                      f"got {self.exact_prefix}")

    @property
    def context(self) -> tuple[tuple[int, ...], ...]:
        return self.segments[:-1]

    @property
    def question(self) -> tuple[int, ...]:
        return self.segments[-1]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)
