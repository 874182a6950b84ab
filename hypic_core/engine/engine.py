"""The engine: requests in, a stream of `StepOutput`s out, one `step()` at a time.

`add_request` validates a request once and queues it as a `Sequence`; `step()` is
schedule -> execute -> update:

1. **schedule** (hypic_core/engine/scheduler.py): one decode token for every running sequence, and a
   token budget of prefill work for sequences part-way through their prefill, then for waiting
   ones it admits (the scheduler asks the context-cache manager, hypic_core/engine/context_cache.py, to
   lay out each one's prefill with the strategy of its mode, hypic_core/engine/prefill.py).
2. **execute**: the step's model work. Missing canonical entries of every sequence in the step
   are computed together (a segment several sequences need, once); with a prefill pool
   (hypic_core/prefill_pool) on its workers instead, while the steps go on. Then each sequence's
   runs (an exact run of leading segments, the whole prompt in `full`) and stitch, cut to its
   budget, so a long cold prompt spreads over steps; then all running sequences advance in ONE
   batched decode forward (`DecodeBatch`). It leaves next-token logits per sequence.
3. **update** (hypic_core/engine/output.py): sample, detokenize, apply EOS / stop strings / length
   limits; one `StepOutput` per sequence that produced a token or ended; finished ones leave.
4. **background**: what is left of the step's token budget goes to deferred cold work, the
   entries a cold request served by one exact forward left missing (`EngineConfig.cold_prefill`);
   never in a step that produced a first token, and on the prefill pool when there is one.

One thread should drive `step()` (the gateway's worker does); `generate()` drives it for a
caller that has no such thread, and several callers may use it at once. Model calls are
serialised by the step lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from ..adapters import adapter_for
from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey, model_fingerprint
from ..cache.exact_runs import ExactRuns
from ..cache.store import MemorySegmentStore, SegmentStore
from ..config import EngineConfig, GenerationRequest
from ..errors import InvalidRequestError, PromptTooLongError
from ..runner.model_runner import ModelRunner
from ..runner.verify_step import Verified, VerifyStep
from .context_cache import ColdWork, ContextCacheManager
from .drafting import DraftBudget, DraftCost, PromptLookup
from .lookups import Lookups
from .output import OutputProcessor
from .prefill import CostModel, looks_up
from .scheduler import ScheduledStep, Scheduler, SchedulerConfig
from .sequence import AbortHandle, PrefillProgress, PrefillStats, Run, Sequence, Status, StepOutput

__all__ = ["AbortHandle", "Engine", "EntryLookup", "PrefillResult", "PrefillStats", "StepOutput"]


# How long a step with nothing running waits for the cache lookups in flight (then it runs what it has).
LOOKUP_WAIT_S = 1.0


class EntryLookup(NamedTuple):
    entries: list[SegmentEntry]
    hits: list[bool]  # whether each entry came from the store


@dataclass
class PrefillResult:
    """A finished prefill (the `prefill` helper's result; `generate(prefilled=...)` decodes from it)."""

    cache: object
    position: int  # next free position
    logits: torch.Tensor  # first-token logits, fp32
    stats: PrefillStats


@dataclass
class Executed:
    """What a step's model work left: next-token logits per sequence, or the error that ended it."""

    logits: dict[Sequence, torch.Tensor] = field(default_factory=dict)  # [vocab]; [n, vocab] for a verified row
    errors: dict[Sequence, BaseException] = field(default_factory=dict)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # the draft tokens each verified row was fed (maybe none)
    verified: Verified | None = None  # the decode ran as one verification forward (speculation)
    verify_seconds: float = 0.0  # its forward's time


@dataclass
class SpeculationStats:
    """Counters of speculative decoding since start (the gateway exports them)."""

    drafted: int = 0  # draft tokens fed to verification forwards
    accepted: int = 0  # of them, the tokens the model agreed with (emitted without a step of their own)
    verify_steps: int = 0  # decode steps that ran as a verification forward


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 store: SegmentStore | None = None, model_id: str = "model", prefill_pool=None):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.runner = ModelRunner(model, self.adapter, pad_token_id=pad or 0, entry_prefix=self.config.entry_prefix)
        if self.config.decode_step != "module":
            self.runner.use_decode_step(self.config.decode_step)
        self.model_id = model_id
        self.fingerprint = model_fingerprint(model, model_id, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_ids = _eos_ids(model, tokenizer)
        self.output = OutputProcessor(tokenizer)
        self.kv_bytes_per_token, self.state_bytes, state_elements = self._footprint()
        self._lock = threading.RLock()  # one step (one set of model calls) at a time
        # Parallel cold prefill (hypic_core/prefill_pool): cold entries computed by replicas on other
        # processes. None: computed here, in this thread, as part of each step's token budget.
        if prefill_pool is not None and self.config.entry_prefix:
            raise ValueError("entry_prefix is not supported with a prefill pool yet (its replicas compute entries alone)")
        if prefill_pool is not None and prefill_pool.split_tokens:  # its entries approximate the canonical ones
            self.fingerprint = hashlib.sha256(f"{self.fingerprint}/split{prefill_pool.split_tokens}".encode()).hexdigest()
        store = store if store is not None else MemorySegmentStore(self.config.memory_budget_bytes)
        self.context = ContextCacheManager(self.runner, store, self.config, self.fingerprint)
        self.context.cost = CostModel.of(model, self.adapter, state_elements)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_running, self.config.max_step_tokens,
                                                   self.config.running_budget_bytes), self.context, self.config.scheduling)
        self.pool = self.context.pool = prefill_pool
        if prefill_pool is not None:
            prefill_pool.bind(self.fingerprint, self.runner)
        self.speculation = SpeculationStats()
        self._verify: VerifyStep | None = None  # built on the first draft (speculation needs the lean decode step)
        self._draft_cost = DraftCost(self.config.speculation_cost)
        # A store that reads disk or Redis is looked up off the engine thread (lookups.py).
        self.lookups = Lookups(self.context.prefetch, self.scheduler.add) if getattr(store, "slow", False) else None

    @property
    def store(self) -> SegmentStore:
        """The segment store of canonical entries (the context-cache manager's)."""
        return self.context.store

    @property
    def exact_runs(self) -> ExactRuns:
        """The exact snapshots of leading segment runs (the context-cache manager's)."""
        return self.context.exact_runs

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, store: SegmentStore | None = None,
                        dtype: str | torch.dtype = torch.float32, device: str = "cpu", model_id: str | None = None,
                        prefill_workers: int = 0, prefill_backend: str = "processes",
                        prefill_threads: int | None = None, ray_address: str | None = None,
                        prefill_split_tokens: int = 0) -> "Engine":
        """Load a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer) onto
        `device` in `dtype` ("auto": see `loader.pick_dtype`). Offline only.

        `prefill_workers` > 0 computes cold entries on that many replicas of the checkpoint
        (`prefill_backend`: "processes" or "ray", joining `ray_address` or a local Ray; `prefill_threads`
        torch threads each, default the cores split between them; `prefill_split_tokens` > 0: longer
        segments are split into pieces, an approximation); see hypic_core/prefill_pool."""
        from ..models.loader import load_local

        model, tokenizer = load_local(path, dtype=dtype, device=device)
        pool = None
        if prefill_workers:
            from ..prefill_pool import PrefillPool, ReplicaSpec

            pool = PrefillPool(ReplicaSpec(str(path), model.dtype, device, prefill_threads), prefill_workers, prefill_backend,
                               ray_address=ray_address, split_tokens=prefill_split_tokens)
        return cls(model, tokenizer, config, store, model_id=model_id or Path(path).name, prefill_pool=pool)

    def close(self) -> None:
        """Stop the prefill pool's workers, if any (the engine computes cold entries itself afterwards)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = self.context.pool = None

    @property
    def max_positions(self) -> int:
        return self.adapter.max_positions

    def _footprint(self) -> tuple[int, int, int]:
        """(attention K/V bytes per token, linear conv + state bytes per sequence, linear state elements
        per sequence), measured on one token."""
        with torch.inference_mode():
            cache = self.runner.new_cache()
            self.runner.forward([0], 0, cache)
            keys, values = self.runner.attention.kv(cache)
            kv = sum(t.numel() * t.element_size() for t in (*keys, *values))
            rows = self.runner.linear.rows(cache)
            state = sum(t.numel() * t.element_size() for pair in rows for t in pair)
            elements = sum(pair[1].numel() for pair in rows)
        return kv, state, elements

    # --- requests -------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError / PromptTooLongError for a request the model cannot take."""
        for i, seg in enumerate(request.segments):
            bad = [t for t in seg if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"segments[{i}]", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if request.prompt_tokens >= self.max_positions:
            raise PromptTooLongError(
                "prompt", f"{request.prompt_tokens} tokens; the model's context is {self.max_positions} tokens"
            )

    def add_request(self, request: GenerationRequest, abort: AbortHandle | None = None,
                    prefilled: PrefillResult | None = None, collect: bool = False) -> Sequence:
        """Validate `request` and queue it; raises InvalidRequestError (naming the field) for a bad one.

        `abort` (optional) stops it from any thread. `prefilled` skips the prefill (the
        sequence decodes from that cache). `collect` keeps its outputs in `seq.outbox` for
        callers that drive `step()` themselves.
        """
        seq = self._sequence(request, abort, collect)
        if not self.scheduler.can_ever_fit(seq):
            raise InvalidRequestError(
                "max_tokens", f"the prompt ({request.prompt_tokens} tokens) plus max_tokens ({seq.max_new_tokens}) need "
                f"{seq.reserved_bytes / 2**20:.1f} MiB of cache; the engine holds at most "
                f"{self.config.running_budget_bytes / 2**20:.1f} MiB")
        if prefilled is not None:
            seq.prefill = PrefillProgress(prefilled.cache, logits=prefilled.logits)
            seq.stats, seq.prefill_left = prefilled.stats, 1
        elif self.lookups is not None and looks_up(seq.mode):
            self.lookups.submit(seq)  # queued once its segments are looked up, off this thread
            return seq
        self.scheduler.add(seq)
        return seq

    def _sequence(self, request: GenerationRequest, abort: AbortHandle | None = None, collect: bool = False) -> Sequence:
        """A validated `Sequence` for `request` (not queued)."""
        self.validate(request)
        seam = self.config.seam if request.seam is None else request.seam
        max_new = min(request.sampling.max_tokens, self.max_positions - request.prompt_tokens)
        reserved = (request.prompt_tokens + max_new) * self.kv_bytes_per_token + self.state_bytes
        return Sequence(request, seam, self.output.sampler(request.sampling), self.output.detokenizer(request.sampling.stop),
                        self.eos_ids, max_new, reserved, abort=abort or AbortHandle(), collect=collect)

    def set_limits(self, max_running: int, max_step_tokens: int, running_budget_bytes: int) -> None:
        """Replace the scheduler's limits (a gateway applies its settings to an engine it was given).
        Call while no request is in the engine."""
        self.config = dataclasses.replace(self.config, max_running=max_running, max_step_tokens=max_step_tokens,
                                          running_budget_bytes=running_budget_bytes)
        self.scheduler.config = SchedulerConfig(max_running, max_step_tokens, running_budget_bytes)
        self.context.config = self.config

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.lookups is not None and self.lookups.pending > 0)

    def has_background_work(self) -> bool:
        """Deferred cold work is waiting (`step()` computes it, also with no request in the engine)."""
        return bool(self.context.pending_background())

    def drain_background(self) -> None:
        """Run steps until no deferred cold work is left (tests, benchmarks: a following request then hits
        the entries; the gateway's engine thread steps while `has_background_work()`)."""
        while self.has_background_work():
            self.step()

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one step (see the module docstring); return what it produced, in no particular order."""
        if self.lookups is not None and self.lookups.pending and not self.scheduler.num_active:
            # Nothing runs yet: wait (briefly) for the lookups in flight, so requests added together
            # are admitted together. With sequences running, a step never waits for a lookup.
            self.lookups.wait(LOOKUP_WAIT_S)
        with self._lock, torch.inference_mode():
            scheduled = self.scheduler.schedule()
            executed = self._execute(scheduled)
            outputs = self._update(scheduled, executed)
            try:
                self._run_background(scheduled, executed)
            except Exception as exc:  # noqa: BLE001 - no request waits for it: drop it, never fail the step
                self.context.abandon_background(exc)
            return outputs

    def generate(self, request: GenerationRequest, abort: AbortHandle | None = None,
                 prefilled: PrefillResult | None = None) -> Iterator[StepOutput]:
        """Add `request` and drive `step()` until it finishes, yielding its outputs; the last has finish_reason.

        Raises the engine's errors for a bad request before yielding anything. Other requests
        in the engine advance too (they share the steps). Closing the iterator aborts it.
        """
        seq = self.add_request(request, abort, prefilled, collect=True)
        try:
            while True:
                if not seq.outbox:
                    self.step()
                while seq.outbox:
                    out = seq.outbox.pop(0)
                    yield out
                    if out.finish_reason is not None:
                        return
        finally:
            if not seq.finished:
                seq.abort.abort()

    def generated_tokens(self, request: GenerationRequest) -> list[int]:
        """Every generated token id, EOS excluded (tests, evaluation)."""
        return [e.token_id for e in self.generate(request) if e.token_id is not None and e.token_id not in self.eos_ids]

    def prefill(self, request: GenerationRequest) -> PrefillResult:
        """Prefill `request` alone, at once, with the same layout and execution as `step()` (tests, benchmarks)."""
        seq = self._sequence(request)
        with self._lock, torch.inference_mode():
            seq.first_scheduled = seq.arrival
            self.context.plan(seq)
            if seq.error is not None:
                raise seq.error
            while seq.prefill.logits is None:
                budgets = {seq: 1 << 62}
                self._run_cold(budgets)
                self._advance(seq, budgets[seq])
        return PrefillResult(seq.prefill.cache, request.prompt_tokens, seq.prefill.logits, seq.stats)

    def segment_entries(self, segments: tuple[tuple[int, ...], ...], seam: int, salt: str = "") -> EntryLookup:
        """Canonical entries for `segments` under `salt` (misses computed together and stored), with hit flags."""
        keys = [SegmentKey.of(self.fingerprint, seam, s, salt, self.config.entry_prefix) for s in segments]
        found = [self.store.lookup(k, s) for k, s in zip(keys, segments)]
        hits = [e is not None for e in found]
        todo = list(dict.fromkeys(s for s, e in zip(segments, found) if e is None))
        if todo:
            with self._lock, torch.inference_mode():
                computed = dict(zip(todo, (self.pool or self.runner).compute_entries(todo, seam, self.config.max_cold_batch_tokens)))
            for i, (k, s) in enumerate(zip(keys, segments)):
                if found[i] is None:
                    found[i] = computed[s]
                    self.store.insert(k, computed[s])
        return EntryLookup(found, hits)  # type: ignore[arg-type]

    # --- execute -------------------------------------------------------------------------
    def _execute(self, scheduled: ScheduledStep) -> Executed:
        """The step's model work: cold entries, prefill runs and stitches within each grant, then one decode forward."""
        done = Executed()
        if scheduled.prefills:
            self._run_prefills(scheduled.prefills, done, wait=not scheduled.decodes)
        if scheduled.decodes:
            self._run_decode(scheduled.decodes, done)
        return done

    def _run_prefills(self, grants: list[tuple[Sequence, int]], done: Executed, wait: bool = True) -> None:
        """Spend each granted budget on its sequence's prefill; cold entries of all of them are computed together
        (`wait`: with a prefill pool, block until some arrive when nothing else could advance)."""
        budgets: dict[Sequence, int] = {}
        for seq, grant in grants:
            if seq.error is not None:
                done.errors[seq] = seq.error
            else:
                budgets[seq] = grant
        try:
            self._run_cold(budgets, wait)
        except Exception as exc:
            done.errors.update(dict.fromkeys(budgets, exc))
            return
        for seq, budget in budgets.items():
            try:
                seq.stats.prefill_steps += 1
                self._advance(seq, budget)
                seq.prefill_left = seq.prefill.tokens_left(seq)
                if seq.prefill.logits is not None:
                    done.logits[seq] = self._start_decoding(seq)
            except Exception as exc:
                done.errors[seq] = exc

    def _run_cold(self, budgets: dict[Sequence, int], wait: bool = True) -> None:
        """Compute missing entries within the budgets (mutated): whole segments batched together
        (per seam width), and one piece of each segment longer than what is left of its budget.
        With a prefill pool, `_run_cold_pool` instead."""
        if self.pool is not None:
            return self._run_cold_pool(budgets, wait)
        whole: dict[int, list[ColdWork]] = {}
        chosen: set[int] = set()
        spent = 0  # prefill tokens given out in this step so far
        for seq, budget in budgets.items():
            for cw, _ in seq.prefill.cold:
                if budget <= 0:
                    break
                if cw.entry is not None or id(cw) in chosen:
                    continue
                chosen.add(id(cw))
                n = len(cw.segment)
                # A segment that fits a whole step goes in one piece when it opens the step, even if
                # the decode tokens took a few of the step's tokens (pieces cost more than one pass).
                if cw.part is None and (n <= budget or (spent == 0 and n <= self.config.max_step_tokens)):
                    whole.setdefault(cw.seam, []).append(cw)
                    budget -= n
                    spent += n
                else:
                    t = time.perf_counter()
                    cw.part = cw.part or self.runner.start_entry(cw.segment, cw.seam)
                    n = min(budget, cw.part.left)
                    cw.entry = self.runner.advance_entry(cw.part, n)
                    budget -= n
                    spent += n
                    seq.stats.computed_tokens += n
                    _add_ms(seq.stats, "cold", t)
            budgets[seq] = max(budget, 0)
        for seam, works in whole.items():
            t = time.perf_counter()
            entries = self.runner.compute_entries([cw.segment for cw in works], seam, self.config.max_cold_batch_tokens)
            for cw, entry in zip(works, entries):
                cw.entry = entry
            holders = {seq for seq in budgets for cw, _ in seq.prefill.cold if cw in works}
            for seq in holders:
                seq.stats.computed_tokens += sum(len(cw.segment) for cw, _ in seq.prefill.cold if cw in works)
                _add_ms(seq.stats, "cold", t)
        self.context.hand_over(budgets)

    def _run_cold_pool(self, budgets: dict[Sequence, int], wait: bool) -> None:
        """Cold entries on the prefill pool: every new cold segment of the step's sequences goes to
        the pool at once (it orders them longest first), whole and outside the token budgets (the
        work runs on other processes). Finished ones are handed over; when `wait` and no sequence
        could advance without one, block until one arrives."""
        pending = list({id(cw): cw for seq in budgets for cw, _ in seq.prefill.cold if cw.entry is None}.values())
        t = time.perf_counter()
        blocked = all(any(cw.entry is None for cw, _ in seq.prefill.cold) for seq in budgets)
        self._pool_exchange(pending, wait=wait and bool(pending) and blocked)
        for seq in budgets:
            if seq.prefill.cold:
                _add_ms(seq.stats, "cold", t)
                seq.stats.computed_tokens += sum(len(cw.segment) for cw, _ in seq.prefill.cold if cw.entry is not None)
        self.context.hand_over(budgets)

    def _advance(self, seq: Sequence, budget: int) -> None:
        """Run up to `budget` tokens of `seq`'s remaining prefill (cold work is done by `_run_cold`):
        its runs (an exact run; the whole prompt in `full`), then the stitch of the cached segments,
        then what is left of the question."""
        progress, request, runner, stats = seq.prefill, seq.request, self.runner, seq.stats
        if progress.logits is not None or progress.cold or budget <= 0:
            return
        budget = self._run_runs(seq, budget)
        if progress.stitch_pending and not progress.runs and budget > 0:
            t = time.perf_counter()
            seams = stats.seam_tokens
            head = max(1, min(len(request.question), budget - seams))
            context = request.context[progress.exact:]
            logits = runner.stitch(progress.cache, context, progress.entries[progress.exact:], request.question[:head],
                                   request.mode, start=progress.start)
            progress.stitch_pending = False
            stats.computed_tokens += seams + head
            budget -= seams + head
            start = request.prompt_tokens - len(request.question) + head
            if head < len(request.question):
                progress.runs.append(Run(request.question[head:], start))
            else:
                progress.logits = logits
            _add_ms(stats, "stitch", t)
            self._run_runs(seq, budget)

    def _run_runs(self, seq: Sequence, budget: int) -> int:
        """Run `seq`'s pending runs within `budget`; returns what is left of it. The last run of an
        exact run keeps it (a snapshot); the last run of a prefill yields the first-token logits."""
        progress, runner, stats = seq.prefill, self.runner, seq.stats
        while progress.runs and budget > 0:
            t = time.perf_counter()
            run = progress.runs[0]
            n = min(budget, len(run.ids) - run.done)
            last = len(progress.runs) == 1 and run.done + n == len(run.ids) and not progress.stitch_pending
            logits = runner.forward(run.ids[run.done:run.done + n], run.start + run.done, progress.cache, logits=last)
            run.done += n
            budget -= n
            stats.computed_tokens += n
            if run.done == len(run.ids):
                progress.runs.popleft()
                if run.boundary:
                    progress.boundaries.append(run.start + len(run.ids))
                    progress.linear.append(runner.linear_snapshot(progress.cache))
                    if progress.snapshot_due and not any(r.boundary for r in progress.runs):
                        self.context.keep_exact_run(progress)
            if last:
                progress.logits = logits
                if progress.deferred:  # its first token is due: what it left missing becomes background work
                    self.context.defer(progress)
            _add_ms(stats, progress.timing, t)
        return budget

    def _run_background(self, scheduled: ScheduledStep, executed: Executed) -> None:
        """Deferred cold work (ContextCacheManager.defer) in what is left of the step's token budget,
        oldest first: whole segments batched together, a longer one piece by piece over steps, as
        `_run_cold` computes a request's misses (so the entries are the ones the cold path builds). Not
        in a step that produced a first token (it would delay it); work a sequence now waits for is
        left to that sequence's prefill. With a prefill pool, on its workers, outside the budget."""
        pending = [cw for cw in self.context.pending_background() if cw.holders <= 0]
        if not pending or any(seq in executed.logits for seq, _ in scheduled.prefills):
            return
        if self.pool is not None:
            return self._run_background_pool(pending, idle=not scheduled.prefills and not scheduled.decodes)
        budget = self.config.max_step_tokens - len(scheduled.decodes) - sum(grant for _, grant in scheduled.prefills)
        whole: dict[int, list[ColdWork]] = {}
        for cw in pending:
            if budget <= 0:
                break
            n = len(cw.segment)
            if cw.part is None and n <= budget:
                whole.setdefault(cw.seam, []).append(cw)
                budget -= n
                continue
            cw.part = cw.part or self.runner.start_entry(cw.segment, cw.seam)
            n = min(budget, cw.part.left)
            budget -= n
            entry = self.runner.advance_entry(cw.part, n)
            if entry is not None:
                cw.entry, cw.part = entry, None
                self.context.finish_background(cw)
        for seam, works in whole.items():
            for cw, entry in zip(works, self.runner.compute_entries([cw.segment for cw in works], seam,
                                                                    self.config.max_cold_batch_tokens)):
                cw.entry = entry
                self.context.finish_background(cw)

    def _run_background_pool(self, pending: list[ColdWork], idle: bool) -> None:
        """Deferred cold work on the prefill pool: submitted at once; when the engine has nothing else to
        do (`idle`), wait for one to arrive."""
        for cw in self._pool_exchange(pending, wait=idle):
            self.context.finish_background(cw)

    def _pool_exchange(self, works: list[ColdWork], wait: bool) -> list[ColdWork]:
        """One round with the prefill pool over `works` (distinct, entries missing): submit those not
        yet on it, block until one is done (`wait`) or just poll, and take every finished entry
        into its work; returns the works that got their entry."""
        pool = self.pool
        new = [cw for cw in works if cw.ticket is None]
        for cw, ticket in zip(new, pool.submit([(cw.segment, cw.seam) for cw in new])):
            cw.ticket = ticket
        if wait:
            pool.wait_any([cw.ticket for cw in works])
        else:
            pool.poll()
        done = []
        for cw in works:
            entry = pool.take(cw.ticket)
            if entry is not None:
                cw.entry, cw.ticket = entry, None
                done.append(cw)
        return done

    def _start_decoding(self, seq: Sequence) -> torch.Tensor:
        """Prefill done: the sequence decodes from the next step; returns its first-token logits."""
        progress = seq.prefill
        seq.cache, seq.logits, seq.position = progress.cache, progress.logits, seq.request.prompt_tokens
        seq.prefill, seq.status, seq.prefill_left = None, Status.RUNNING, 0
        if seq.first_scheduled is not None:
            seq.stats.timings_ms["prefill"] = _ms(seq.first_scheduled)
        return seq.logits

    def _run_decode(self, seqs: list[Sequence], done: Executed) -> None:
        """Feed every running sequence its last token in one batched forward."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        try:
            if self.adapter.supports_batched_decode:
                batch = self.runner.batch
                batch.sync(live, {s: s.cache for s in live if s.cache is not None})
                for s in live:
                    s.cache = None  # its rows live in the batch now
                drafts = self._drafts(batch.keys)
                t0 = time.perf_counter()
                if drafts:  # one verification forward: each row its last token and its draft (hypic_core/runner/verify_step.py)
                    fed = [[s.output_ids[-1], *drafts.get(s, ())] for s in batch.keys]
                    done.verified = self._verify.verify(batch, fed, [s.position for s in batch.keys])
                    done.verify_seconds = time.perf_counter() - t0
                    self._draft_cost.verify(len(fed), sum(map(len, drafts.values())), done.verify_seconds)
                    done.drafts = {s: list(drafts.get(s, ())) for s in batch.keys}
                    self.speculation.verify_steps += 1
                    for r, s in enumerate(batch.keys):
                        done.logits[s] = done.verified.logits[r, :len(fed[r])]
                    return  # positions advance by what each row keeps (`_update`)
                rows = batch.forward([s.output_ids[-1] for s in batch.keys], [s.position for s in batch.keys])
                logits = dict(zip(batch.keys, rows))
                self._draft_cost.plain(len(rows), time.perf_counter() - t0)
            else:
                logits = {s: self.runner.forward([s.output_ids[-1]], s.position, s.cache, logits=True) for s in live}
        except Exception as exc:
            self.runner.batch.sync([], {})
            done.errors.update(dict.fromkeys(live, exc))
            return
        for s in live:
            s.position += 1
            done.logits[s] = logits[s]

    # --- update ------------------------------------------------------------------------
    def _update(self, scheduled: ScheduledStep, executed: Executed) -> list[StepOutput]:
        """Sample every sequence the step left logits for; end the aborted and the failed ones."""
        outputs = [self._finish(seq, "abort") for seq in scheduled.aborted]
        outputs += [self._finish(seq, "error", exc) for seq, exc in executed.errors.items()]
        kept: dict[Sequence, int] = {}
        for seq, logits in executed.logits.items():
            if seq in executed.drafts:  # a row of the verification forward: logits after each token it was fed
                outs = self._accept(seq, logits, executed.drafts[seq])
                kept[seq] = len(outs)
                outputs += outs
            else:
                outputs.append(self._sample(seq, logits))
        if executed.verified is not None:  # each row keeps the tokens it emitted from (rolls back the rest)
            batch = self.runner.batch
            VerifyStep.commit(batch, executed.verified, [kept.get(s, 1) for s in batch.keys])
            for s in batch.keys:
                s.position += kept.get(s, 1)
            self._draft_cost.verified(len(batch.keys), sum(kept.values()), executed.verify_seconds)
        self.runner.batch.sync([s for s in self.runner.batch.keys if not s.finished], {})
        return outputs

    def _accept(self, seq: Sequence, logits: torch.Tensor, draft: list[int]) -> list[StepOutput]:
        """Tokens from a verification's logits [n, vocab]: the token after each fed token, while the one
        chosen equals the draft token fed next (greedy: the argmax; sampling: the speculative rejection
        rule, `Sampler`), and the first that does not; none after the sequence ends."""
        outs: list[StepOutput] = []
        for t in range(logits.shape[0]):
            guess = draft[t] if t < len(draft) else None
            out = self._emit(seq, self.output.next_token(seq, logits[t], draft=guess))
            outs.append(out)
            if out.finish_reason is not None or guess is None or out.token_id != guess:
                break
        if draft:
            accepted = sum(1 for t, o in enumerate(outs) if t < len(draft) and o.token_id == draft[t])
            seq.draft_budget.record(len(draft), accepted)
            self.speculation.accepted += accepted
        return outs

    def _drafts(self, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Prompt-lookup drafts (hypic_core/engine/drafting.py) of the sequences that speculate; {} when none
        drafts or the batch's decode step cannot verify (the lean step's families only)."""
        if not any(self._speculates(s) for s in seqs):
            return {}
        step = self.runner.batch.step
        if self._verify is None or self._verify.lean is not step:
            self._verify = VerifyStep.build(self.runner.batch)
        if self._verify is None or not self._draft_cost.ready(len(seqs)) or not self._draft_cost.pays(len(seqs)):
            return {}  # no plain step of this size timed yet, or verification has not paid at this size lately
        # A plain step of B rows yields B tokens; one row's draft token makes the whole step dearer by the
        # measured price, i.e. by B tokens' worth of that row's share.
        price = self._draft_cost.cost(len(seqs)) * len(seqs)
        drafts: dict[Sequence, list[int]] = {}
        for s in seqs:
            if not self._speculates(s):
                continue
            if s.drafter is None:
                s.drafter = PromptLookup([t for seg in s.request.segments for t in seg], self.config.speculation_ngram,
                                         self.config.speculation_min_ngram)
                s.draft_budget = DraftBudget(self.config.speculation_max_draft)
            s.draft_budget.cost = price  # what a drafted token costs at this batch size on this machine now
            k = min(s.draft_budget.next_k(), s.max_new_tokens - s.num_generated - 1, self.max_positions - s.position - 2)
            if k <= 0:
                continue
            s.drafter.extend(s.output_ids[len(s.drafter.tokens) - s.request.prompt_tokens:])
            draft = s.drafter.propose(k)
            if draft:
                drafts[s] = draft
                self.speculation.drafted += len(draft)
        return drafts

    def _speculates(self, seq: Sequence) -> bool:
        wanted = seq.request.speculation
        return self.config.speculation if wanted is None else wanted

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        """`seq`'s next token (hypic_core/engine/output.py); a sequence that ends here is released."""
        return self._emit(seq, self.output.next_token(seq, logits))

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> StepOutput:
        """End `seq` without a new token ("abort" or "error")."""
        return self._emit(seq, self.output.ended(seq, reason, error))

    def _emit(self, seq: Sequence, out: StepOutput) -> StepOutput:
        if out.finish_reason is not None:
            self._release(seq, out.finish_reason)
        if seq.collect:
            seq.outbox.append(out)
        return out

    def _release(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.context.release(seq)
        seq.prefill = seq.cache = seq.logits = None
        self.scheduler.finish(seq)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _ms(t0: float, t1: float | None = None) -> float:
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000.0, 3)


def _add_ms(stats: PrefillStats, name: str, t0: float) -> None:
    stats.timings_ms[name] = round(stats.timings_ms.get(name, 0.0) + _ms(t0), 3)
