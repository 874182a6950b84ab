"""One request's whole life in the engine: a `Sequence`, its prefill progress, and what each engine step says of it.

A sequence is created by `Engine.add_request` (validated once, there), waits in the scheduler,
prefills over one or more steps (its `prefill`, a `PrefillProgress` laid out by the context
cache manager when the scheduler admits it, holds the work in progress), joins the decode
batch, and finishes with a reason. The engine thread owns every field except `abort`, which any
thread may set; the engine notices it at the start of the next step.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..algebra.entry import SegmentEntry
from ..config import GenerationRequest, Mode
from ..errors import InvalidRequestError, PromptTooLongError
from .detokenizer import IncrementalDetokenizer, StreamDetokenizer
from .drafting import DraftBudget
from .sampling import Sampler

if TYPE_CHECKING:
    from .entry_builder import EntryJob

_ids = itertools.count()


class AbortHandle:
    """Set from any thread to stop a request; the engine checks it at the start of every step."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def abort(self) -> None:
        self._event.set()

    @property
    def aborted(self) -> bool:
        return self._event.is_set()


class Status(enum.Enum):
    LOOKING_UP = "looking_up"  # its segments' stored-tier lookups are out (lookups.py); not yet in the scheduler
    WAITING = "waiting"  # admitted, not yet scheduled
    PREFILLING = "prefilling"  # its prompt is being computed, possibly over several steps
    RUNNING = "running"  # decoding one token per step
    FINISHED = "finished"


@dataclass(frozen=True)
class SegmentUse:
    """How one context segment of a prompt was computed: `reused` of its `tokens` restored exactly
    from a snapshot (`how` "exact") or composed from its cached entry ("composed"), `seam` of them
    recomputed in context, the rest (`computed`) computed for this request ("computed": no reuse)."""

    how: str
    tokens: int
    reused: int = 0
    seam: int = 0

    @property
    def computed(self) -> int:
        return self.tokens - self.reused - self.seam


@dataclass
class PrefillStats:
    """How a request's prompt was computed. Token counts do not overlap except where noted."""

    mode: str
    seam: int
    prompt_tokens: int = 0
    # What the prompt's tokens got, a partition: prompt_tokens = exact + composed + seam + fresh (a property).
    exact_tokens: int = 0  # restored from an exact snapshot (identical to recomputing them)
    composed_tokens: int = 0  # segment bodies reused from cache hits by position-independent composition
    seam_tokens: int = 0  # seam heads recomputed in context
    computed_tokens: int = 0  # model work done for this request, in tokens (cold entries + seams + runs); a cold
    #                           segment's body counts once here, and a seam-covered head can count twice
    # per context segment, in prompt order; its counts sum to exact_tokens, composed_tokens and seam_tokens
    segments: list[SegmentUse] = field(default_factory=list)
    segment_hits: int = 0
    segment_misses: int = 0
    prefill_steps: int = 0  # engine steps the prefill was spread over (chunked prefill)
    exact_forward: bool = False  # a cold pic-mode request served by one exact forward (EngineConfig.cold_prefill)
    timings_ms: dict[str, float] = field(default_factory=dict)  # queue, lookup, cold, stitch, prefill

    @property
    def fresh_tokens(self) -> int:
        """The rest of the prompt, computed for this request: the question, exact-prefix misses,
        full/prefix forwards, and the bodies of segments whose entries were computed now (cold misses)."""
        return self.prompt_tokens - self.exact_tokens - self.composed_tokens - self.seam_tokens

    @property
    def cached_tokens(self) -> int:
        """Tokens reused exactly (restored from a snapshot): what `usage.cached_tokens` reports."""
        return self.exact_tokens


@dataclass(frozen=True)
class Run:
    """Tokens to run through all layers at positions start.. on the sequence's cache. How much of it is
    done is the sequence's cursor (`Sequence.num_computed_tokens`), never the run's."""

    ids: tuple[int, ...]
    start: int
    boundary: bool = False  # the end of a context segment in an exact run: snapshot the linear states there

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(eq=False)
class PrefillProgress:
    """A sequence's prefill work in progress (engine thread only). What is left, in order: cold
    entries (`cold`, shared with other sequences), `runs` (an exact run; the whole prompt in
    `full`), the stitch of the cached segments after the exact run (positions `start` to
    `stitch_end`), and the question's runs; the last run leaves the first-token `logits`. Where the
    prefill stands is the sequence's one cursor, `Sequence.num_computed_tokens`: the runs and the
    stitch are laid out by position, so the cursor says which are done."""

    cache: Any  # the sequence's own transformers cache
    # Tokens `cache` held when the prefill was laid out (a restored exact snapshot; the whole prompt of a
    # prefilled request): its first step reports them advanced, as a prefix hit's, and the update moves the cursor.
    in_cache: int = 0
    entries: list[SegmentEntry | None] = field(default_factory=list)  # stitched: one per context segment
    cold: list[tuple["EntryJob", list[int]]] = field(default_factory=list)  # (shared work, entry slots it fills)
    stitch_end: int | None = None  # the position after the stitched segments (None: nothing is stitched)
    runs: deque[Run] = field(default_factory=deque)
    # the exact run (snapshots: hypic_core/cache/exact_runs.py)
    chain: list[str] = field(default_factory=list)  # chained hashes of its segments
    boundaries: list[int] = field(default_factory=list)
    linear: list = field(default_factory=list)  # linear states at each boundary
    reused: int = 0  # leading segments restored from a snapshot
    exact: int = 0  # leading context segments done exactly (restored or run); the rest are stitched
    start: int = 0  # where the stitched segments begin (after the exact run)
    timing: str = "stitch"  # the name runs' time is counted under in `PrefillStats.timings_ms`
    transition: bool = True  # the stitch advances linear states by the bodies' transitions (hypic), or not
    deferred: list = field(default_factory=list)  # (key, segment, seam) of entries to compute after the first token
    # cache columns whose keys the stitch scaled, set back to 1x when the prefill ends (reuse_key_scope "prompt")
    rescale: list[tuple[int, int]] = field(default_factory=list)
    logits: torch.Tensor | None = None

    def stitch_due(self, cursor: int) -> bool:
        """Whether the stitch is still to run, the cursor at `cursor` (the stitch moves it past `stitch_end`)."""
        return self.stitch_end is not None and cursor <= self.stitch_end

    def tokens_left(self, cursor: int, seam_tokens: int, question: int) -> int:
        """Tokens of model work left from `cursor`: cold entries, the stitch (its `seam_tokens` and the
        `question` tokens it may take), the runs' tokens past the cursor."""
        cold = sum(cw.left for cw, _ in self.cold)
        stitch = seam_tokens + question if self.stitch_due(cursor) else 0
        return cold + stitch + sum(r.end - max(r.start, cursor) for r in self.runs)

    @property
    def snapshot_due(self) -> bool:
        """Whether the exact run was (partly) computed here and is not yet kept."""
        return self.reused < self.exact


@dataclass(frozen=True)
class StepOutput:
    """One generated token of one sequence, or its end. The engine's only output type.

    `text` is the newly safe text (may be empty). The last output of a sequence has
    `finish_reason` ("stop", "length", "abort" or "error", with `error` set); `token_id` is None
    when the sequence ended without producing a token in that step. The first output of a
    sequence carries its `stats`, and its first-token `logits` (fp32) when the request asked
    (`keep_logits`).
    """

    request_id: str
    index: int
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    stats: PrefillStats | None = None
    error: BaseException | None = None
    logits: torch.Tensor | None = None


@dataclass(eq=False)  # compared by identity
class Sequence:
    """Everything about one request. Created by `Engine.add_request`."""

    request: GenerationRequest
    seam: int
    sampler: Sampler
    detokenizer: IncrementalDetokenizer | StreamDetokenizer
    eos_ids: frozenset[int]
    max_new_tokens: int  # max_tokens, capped by what is left of the model's context
    reserved_bytes: int  # attention K/V + linear state this sequence holds at most (scheduler's memory budget)
    abort: AbortHandle = field(default_factory=AbortHandle)
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    stats: PrefillStats | None = None
    # The cursor: prompt and output tokens in its cache (a restored snapshot counts). Written only by the
    # step's update (output.py `move_cursors`), from what the executor reports it advanced.
    num_computed_tokens: int = 0
    prefill: PrefillProgress | None = None  # set when admitted, cleared when its decoding starts
    found: list | None = None  # its segments' store entries, looked up as it arrived (lookups.py); None: not yet
    drafter: Any = None  # its PromptLookup (drafting.py), made on its first draft
    draft_budget: DraftBudget = field(default_factory=DraftBudget)  # how many tokens it drafts next
    cache: Any = None  # the sequence's own cache between prefill and joining the decode batch
    logits: torch.Tensor | None = None  # next-token logits waiting to be sampled
    output_ids: list[int] = field(default_factory=list)  # generated tokens, EOS included
    finish_reason: str | None = None
    error: BaseException | None = None  # why its prefill could not be laid out
    collect: bool = False  # keep outputs in `outbox` (callers that drive the engine themselves)
    outbox: list[StepOutput] = field(default_factory=list)
    # Seam heads widened by the request's recompute budget (engine/recompute.py `request_heads`); None: none.
    heads: dict[tuple[int, ...], int] | None = None

    def __post_init__(self) -> None:
        self.stats = PrefillStats(self.request.mode.value, self.seam, prompt_tokens=self.request.prompt_tokens)
        self._prompt_ids = [t for seg in self.request.segments for t in seg]

    @property
    def mode(self) -> Mode:
        return self.request.mode

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefill_left(self) -> int:
        """Tokens of prefill work still to run: from the cursor, once laid out (`prefill`); before that the
        prompt past the cursor (an upper bound); none once decoding or failed."""
        if self.prefill is not None:
            return self.prefill.tokens_left(self.num_computed_tokens, self.stats.seam_tokens, len(self.request.question))
        if self.error is not None or self.status in (Status.RUNNING, Status.FINISHED):
            return 0
        return self.request.prompt_tokens - self.num_computed_tokens

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def history(self) -> list[int]:
        """Prompt and generated token ids (what a repetition penalty looks at)."""
        return self._prompt_ids + self.output_ids

    def banned_tokens(self) -> frozenset[int]:
        """Token ids the sampler must not pick now: EOS until `min_tokens` are generated, and always
        with `ignore_eos` (the sequence then ends only at a stop string or a length limit)."""
        params = self.request.sampling
        if params.ignore_eos or self.num_generated < params.min_tokens:
            return self.eos_ids
        return frozenset()


def validate(request: GenerationRequest, vocab_size: int, max_positions: int) -> None:
    """Raise InvalidRequestError / PromptTooLongError (naming the field) for a request a model of
    `vocab_size` tokens and a context of `max_positions` cannot take."""
    for i, seg in enumerate(request.segments):
        bad = [t for t in seg if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"segments[{i}]", f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if request.prompt_tokens >= max_positions:
        raise PromptTooLongError("prompt", f"{request.prompt_tokens} tokens; the model's context is {max_positions} tokens")
