"""The executor: all model work of one scheduled step (`ScheduledStep`), and nothing else.

1. **cold entries**: the missing canonical entries of every sequence in the step, advanced together
   by the engine's entry builder (hypic_core/engine/entry_builder.py: here within the budgets, or on
   a prefill pool, which is waited on only when no sequence of the step could advance otherwise);
2. **prefill runs**: each sequence's runs (an exact run, the whole prompt in `full`), then the stitch
   of its cached segments, which takes the first question tokens in the same forward, then the
   rest of the question, all cut to the sequence's grant, so a long prompt spreads over steps. An
   exact run is snapshotted once its last boundary run is done;
3. **decode**: every running sequence in ONE batched forward (`DecodeBatch`), or one verification
   forward when some rows draft (hypic_core/engine/speculation.py).

It leaves next-token logits per sequence and the tokens each sequence's cache advanced (`Executed`);
it never moves a sequence's cursor: the update does (output.py `move_cursors`), from what this
reports. Within a step it reads the cursor as `Executed.cursor` (where the sequence stands now).
What is left of the step's budget goes to background cold work (`background`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..runner.model_runner import ModelRunner
from ..runner.verify_step import Verified
from .cache_manager import CacheManager
from .scheduler import ScheduledStep
from .sequence import PrefillStats, Run, Sequence, Status
from .speculation import Speculator


@dataclass
class Executed:
    """What a step's model work left: next-token logits per sequence, or the error that ended it, and
    the tokens each sequence's cache advanced by."""

    logits: dict[Sequence, torch.Tensor] = field(default_factory=dict)  # [vocab]; [n, vocab] for a verified row
    errors: dict[Sequence, BaseException] = field(default_factory=dict)
    # Tokens each sequence's cache holds more than its cursor says: those its forwards and its stitch ran
    # this step, and a restored snapshot's (PrefillProgress.in_cache); a verified row: every token it was
    # fed, the draft included (the update rolls back what it rejects).
    advanced: dict[Sequence, int] = field(default_factory=dict)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # the draft tokens each verified row was fed (maybe none)
    verified: Verified | None = None  # the decode ran as one verification forward (speculation)
    verify_seconds: float = 0.0  # its forward's time

    def cursor(self, seq: Sequence) -> int:
        """Where `seq`'s prefill stands within this step: its cursor and what the step advanced it."""
        return seq.num_computed_tokens + self.advanced.get(seq, 0)

    def advance(self, seq: Sequence, tokens: int) -> None:
        self.advanced[seq] = self.advanced.get(seq, 0) + tokens


class Executor:
    def __init__(self, runner: ModelRunner, cache: CacheManager, speculator: Speculator, config: EngineConfig):
        self.runner, self.cache, self.speculator, self.config = runner, cache, speculator, config

    def execute(self, scheduled: ScheduledStep) -> Executed:
        """The step's model work: cold entries, prefill runs and stitches within each grant, then one decode forward."""
        done = Executed()
        if scheduled.prefills:
            self._prefills(scheduled.prefills, done, wait=not scheduled.decodes)
        if scheduled.decodes:
            self._decode(scheduled.decodes, done)
        return done

    def prefill(self, seq: Sequence) -> Executed:
        """Run `seq`'s laid-out prefill to its first-token logits at once, with no budget; what it advanced."""
        done = Executed()
        self._restored(seq, done)
        while seq.prefill.logits is None:
            budgets = {seq: 1 << 62}
            self._cold(budgets)
            self._advance(seq, budgets[seq], done)
        return done

    def background(self, scheduled: ScheduledStep, executed: Executed) -> None:
        """Deferred cold work (CacheManager.defer) in what is left of the step's token budget, oldest
        first, built as a request's cold entries are (the same bytes); on a prefill pool, outside the
        budget, waiting for one only in an idle step. Not in a step that produced a first token (it
        would delay it); work a sequence now waits for is left to that sequence's prefill."""
        pending = [job for job in self.cache.pending_background() if job.holders <= 0]
        if not pending or any(seq in executed.logits for seq, _ in scheduled.prefills):
            return
        budget = self.config.max_step_tokens - len(scheduled.decodes) - sum(grant for _, grant in scheduled.prefills)
        idle = not scheduled.prefills and not scheduled.decodes
        self.cache.builder.advance([pending], [budget], self.cache, wait=idle)

    # --- prefill -----------------------------------------------------------------------------
    def _prefills(self, grants: list[tuple[Sequence, int]], done: Executed, wait: bool = True) -> None:
        """Spend each granted budget on its sequence's prefill; cold entries of all of them are advanced together."""
        budgets: dict[Sequence, int] = {}
        for seq, grant in grants:
            if seq.error is not None:
                done.errors[seq] = seq.error
            else:
                budgets[seq] = grant
        try:
            self._cold(budgets, wait)
        except Exception as exc:
            done.errors.update(dict.fromkeys(budgets, exc))
            return
        for seq, budget in budgets.items():
            try:
                seq.stats.prefill_steps += 1
                self._restored(seq, done)
                self._advance(seq, budget, done)
                if seq.prefill.logits is not None:
                    done.logits[seq] = self._start_decoding(seq, done)
            except Exception as exc:
                done.errors[seq] = exc

    @staticmethod
    def _restored(seq: Sequence, done: Executed) -> None:
        """The tokens `seq`'s cache held when its prefill was laid out (a restored snapshot) count as advanced
        in its first step, as a prefix hit's do."""
        if done.cursor(seq) < seq.prefill.in_cache:
            done.advance(seq, seq.prefill.in_cache - done.cursor(seq))

    def _cold(self, budgets: dict[Sequence, int], wait: bool = True) -> None:
        """Advance the missing entries of the sequences within their budgets (mutated), then hand the
        finished ones over."""
        seqs = list(budgets)
        built = self.cache.builder.advance([[job for job, _ in s.prefill.cold] for s in seqs], [budgets[s] for s in seqs],
                                           self.cache, opening=self.config.max_step_tokens, wait=wait)
        for seq, b in zip(seqs, built):
            budgets[seq] = b.left
            if b.tokens or b.seconds:
                seq.stats.computed_tokens += b.tokens
                _add_ms(seq.stats, "cold", b.seconds)
        self.cache.hand_over(seqs)

    def _advance(self, seq: Sequence, budget: int, done: Executed) -> None:
        """Run up to `budget` tokens of `seq`'s remaining prefill (cold work is `_cold`'s): its runs, then
        the stitch of the cached segments with the first question tokens, then the rest of the question."""
        progress, request, stats = seq.prefill, seq.request, seq.stats
        if progress.logits is not None or progress.cold or budget <= 0:
            return
        budget = self._runs(seq, budget, done)
        if progress.stitch_due(done.cursor(seq)) and not progress.runs and budget > 0:
            assert done.cursor(seq) == progress.start, "the stitch starts where the exact run ends"
            t = time.perf_counter()
            seams = stats.seam_tokens
            head = max(1, min(len(request.question), budget - seams))
            context = request.context[progress.exact:]
            entries = progress.entries[progress.exact:]
            scale = self.config.reuse_key_scale
            logits = self.runner.stitch(progress.cache, context, entries, request.question[:head], progress.transition,
                                        start=progress.start, key_scale=scale)
            if scale != 1.0 and self.config.reuse_key_scope == "prompt":
                progress.rescale = self.runner.body_columns(context, entries, progress.start)
            done.advance(seq, progress.stitch_end + head - done.cursor(seq))  # past the stitched segments and the head
            stats.computed_tokens += seams + head
            budget -= seams + head
            if head < len(request.question):
                progress.runs.append(Run(request.question[head:], done.cursor(seq)))
            else:
                self._prefilled(progress, logits)
            _add_ms(stats, "stitch", time.perf_counter() - t)
            self._runs(seq, budget, done)

    def _runs(self, seq: Sequence, budget: int, done: Executed) -> int:
        """Run `seq`'s pending runs within `budget`; returns what is left of it. The last boundary run of
        an exact run keeps it (a snapshot); the last run of a prefill yields the first-token logits."""
        progress, stats = seq.prefill, seq.stats
        while progress.runs and budget > 0:
            t = time.perf_counter()
            run, at = progress.runs[0], done.cursor(seq)
            assert run.start <= at < run.end, "runs are laid out from the cursor on"
            n = min(budget, run.end - at)
            last = len(progress.runs) == 1 and at + n == run.end and not progress.stitch_due(at)
            logits = self.runner.forward(run.ids[at - run.start:at - run.start + n], at, progress.cache, logits=last)
            done.advance(seq, n)
            budget -= n
            stats.computed_tokens += n
            if at + n == run.end:
                progress.runs.popleft()
                if run.boundary:
                    progress.boundaries.append(run.start + len(run.ids))
                    progress.linear.append(self.runner.linear_snapshot(progress.cache))
                    if progress.snapshot_due and not any(r.boundary for r in progress.runs):
                        self.cache.keep_exact_run(progress)
            if last:
                self._prefilled(progress, logits)
                if progress.deferred:  # its first token is due: what it left missing becomes background work
                    self.cache.defer(progress)
            _add_ms(stats, progress.timing, time.perf_counter() - t)
        return budget

    def _prefilled(self, progress, logits: torch.Tensor) -> None:
        """The prompt is in the cache: keep its first-token logits, and set the bodies' keys the stitch
        scaled for the prompt alone back to 1x, so the answer reads them as computed."""
        if progress.rescale:
            self.runner.attention.scale_keys(progress.cache, progress.rescale, 1.0 / self.config.reuse_key_scale)
            progress.rescale = []
        progress.logits = logits

    def _start_decoding(self, seq: Sequence, done: Executed) -> torch.Tensor:
        """Prefill done: the sequence decodes from the next step; returns its first-token logits."""
        progress = seq.prefill
        assert done.cursor(seq) == seq.request.prompt_tokens, "the whole prompt is in its cache"
        seq.cache, seq.logits = progress.cache, progress.logits
        seq.prefill, seq.status = None, Status.RUNNING
        if seq.first_scheduled is not None:
            seq.stats.timings_ms["prefill"] = round((time.perf_counter() - seq.first_scheduled) * 1000.0, 3)
        return seq.logits

    # --- decode ------------------------------------------------------------------------------
    def _decode(self, seqs: list[Sequence], done: Executed) -> None:
        """Feed every running sequence its last token in one batched forward (the decode batch's members
        are the live running sequences: they join with their cache, finished ones leave in `update`)."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        batch = self.runner.batch
        try:
            if self.runner.adapter.supports_batched_decode:
                batch.sync(live, {s: s.cache for s in live if s.cache is not None})
                for s in live:
                    s.cache = None  # its rows live in the batch now
                drafts = self.speculator.drafts(batch, batch.keys)
                if drafts:  # each row advances by all it was fed; the update rolls back what it rejects
                    done.verified, logits, done.verify_seconds = self.speculator.verify(batch, drafts)
                    done.drafts = {s: list(drafts.get(s, ())) for s in batch.keys}
                    done.logits.update(logits)
                    for s in batch.keys:
                        done.advance(s, 1 + len(done.drafts[s]))
                    return
                t0 = time.perf_counter()
                rows = batch.forward([s.output_ids[-1] for s in batch.keys], [s.num_computed_tokens for s in batch.keys])
                logits = dict(zip(batch.keys, rows))
                self.speculator.cost.plain(len(rows), time.perf_counter() - t0)
            else:
                logits = {s: self.runner.forward([s.output_ids[-1]], s.num_computed_tokens, s.cache, logits=True) for s in live}
        except Exception as exc:
            batch.sync([], {})
            done.errors.update(dict.fromkeys(live, exc))
            return
        for s in live:
            done.advance(s, 1)
            done.logits[s] = logits[s]

    def leave(self, executed: Executed, kept: dict[Sequence, int]) -> None:
        """After the update: a verification forward's rows keep the tokens they emitted from (`kept`, the update's
        count), the rest of their state is rolled back; finished rows leave the batch."""
        batch = self.runner.batch
        if executed.verified is not None:
            self.speculator.commit(batch, executed.verified, kept, executed.verify_seconds)
        batch.sync([s for s in batch.keys if not s.finished], {})


def _add_ms(stats: PrefillStats, name: str, seconds: float) -> None:
    stats.timings_ms[name] = round(stats.timings_ms.get(name, 0.0) + seconds * 1000.0, 3)
