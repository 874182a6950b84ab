"""The engine: requests in, a stream of `StepOutput`s out, one `step()` at a time.

`add_request` validates a request once and queues it as a `Sequence`; `step()` is
schedule -> execute -> update:

1. **schedule** (scheduler.py): one decode token for every running sequence, and a token budget of
   prefill work, first for sequences part-way through their prefill, then for waiting ones it
   admits (each laid out by the cache manager, cache_manager.py, with the plan of its mode).
2. **execute** (executor.py): the step's model work: cold entries (entry_builder.py, here or on a
   prefill pool), prefill runs and stitches cut to each grant, one batched decode forward.
3. **update** (output.py, speculation.py): move each cursor by what the executor reports its cache
   advanced (a rejected draft rolled back beside it: the only writer of `num_computed_tokens`), sample,
   detokenize, apply EOS / stop strings / length limits; one `StepOutput` per sequence that produced a
   token or ended; finished ones leave.
4. **background**: what is left of the step's budget goes to deferred cold work (executor.py).

One thread should drive `step()` (the gateway's worker does); `generate()` drives it for a
caller that has no such thread, and several callers may use it at once. Model calls are
serialised by the step lock. A driver that routes `step()`'s outputs by request id (the gateway's
engine thread) claims the engine first (`engine.driver.claim`): a second one stepping the same
engine would take the first one's outputs and drop them, so its claim is refused until the first
one releases it.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..adapters import adapter_for
from ..algebra.keys import model_fingerprint
from ..cache.exact_runs import ExactRuns
from ..cache.store import MemorySegmentStore, SegmentStore
from ..config import EngineConfig, GenerationRequest
from ..runner.model_runner import ModelRunner
from .cache_manager import CacheManager, EntryLookup
from .driver import DriverClaim
from .entry_builder import builder_for
from .executor import Executor
from .lookups import Lookups
from .output import OutputProcessor, eos_ids, move_cursors
from .plan import CostModel, looks_up
from .recompute import request_heads
from .scheduler import Scheduler, SchedulerConfig
from .sequence import AbortHandle, PrefillProgress, PrefillStats, Sequence, Status, StepOutput, validate
from .speculation import SpeculationStats, Speculator

__all__ = ["AbortHandle", "Engine", "EntryLookup", "PrefillResult", "PrefillStats", "SpeculationStats", "StepOutput"]


@dataclass
class PrefillResult:
    """A finished prefill (the `prefill` helper's result; `generate(prefilled=...)` decodes from it)."""

    cache: object
    position: int  # next free position
    logits: torch.Tensor  # first-token logits, fp32
    stats: PrefillStats


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 store: SegmentStore | None = None, model_id: str = "model", prefill_pool=None):
        self._config = config = config or EngineConfig()
        self.model, self.tokenizer, self.model_id = model.eval(), tokenizer, model_id
        self.adapter = adapter_for(model)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.runner = ModelRunner(model, self.adapter, pad_token_id=pad or 0, entry_prefix=config.entry_prefix)
        if config.decode_step != "module":
            self.runner.use_decode_step(config.decode_step, kernel=config.decode_kernel)
        self.fingerprint = model_fingerprint(model, model_id, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_ids = eos_ids(model, tokenizer)
        self.output = OutputProcessor(tokenizer)
        self.kv_bytes_per_token, self.state_bytes, state_elements = self.runner.footprint()
        self.max_positions = self.adapter.max_positions
        self._lock = threading.RLock()  # one step (one set of model calls) at a time
        self.driver = DriverClaim(model_id)  # who steps this engine and routes its outputs (a gateway's engine thread)
        # Cold entries: on a prefill pool's replicas (hypic_core/prefill_pool) when there is one, else here.
        self.pool = prefill_pool
        if prefill_pool is not None:  # a pool that splits segments computes entries of another name
            self.fingerprint = prefill_pool.bind(self.fingerprint, self.runner)
        store = store if store is not None else MemorySegmentStore(config.memory_budget_bytes)
        self.cache_manager = self.context = CacheManager(self.runner, store, config, self.fingerprint)  # context: former name
        self.cache_manager.cost = CostModel.of(model, self.adapter, state_elements)
        self.cache_manager.builder = builder_for(self.runner, prefill_pool, config)
        self.scheduler = Scheduler(SchedulerConfig(config.max_running, config.max_step_tokens, config.running_budget_bytes),
                                   self.cache_manager, config.scheduling)
        self.speculator = Speculator(config, self.max_positions)
        self.speculation: SpeculationStats = self.speculator.stats  # counters since start (the gateway exports them)
        self.executor = Executor(self.runner, self.cache_manager, self.speculator, config)
        # A store that reads disk or Redis is looked up off the engine thread, each request within a deadline (lookups.py).
        self.lookups = Lookups(store, self.cache_manager.lookup_keys, self.scheduler.add,
                               config.lookup_deadline_s) if getattr(store, "slow", False) else None

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Replace the engine's settings for the step (sequences, execution, speculation) from now on."""
        self._config = self.executor.config = self.speculator.config = self.cache_manager.config = config
        if self.lookups is not None:
            self.lookups.deadline_s = config.lookup_deadline_s
        self.scheduler.config = SchedulerConfig(config.max_running, config.max_step_tokens, config.running_budget_bytes)

    @property
    def store(self) -> SegmentStore:
        """The segment store of canonical entries (the cache manager's)."""
        return self.cache_manager.store

    @property
    def exact_runs(self) -> ExactRuns:
        """The exact snapshots of leading segment runs (the cache manager's)."""
        return self.cache_manager.exact_runs

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
        from ..prefill_pool import PrefillPool

        model, tokenizer = load_local(path, dtype=dtype, device=device)
        pool = PrefillPool.for_checkpoint(path, model.dtype, device, prefill_workers, prefill_backend, prefill_threads,
                                          ray_address, prefill_split_tokens) if prefill_workers else None
        return cls(model, tokenizer, config, store, model_id=model_id or Path(path).name, prefill_pool=pool)

    def close(self) -> None:
        """Stop the prefill pool's workers, if any (the engine computes cold entries itself afterwards)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
            self.cache_manager.builder = builder_for(self.runner, None, self.config)

    # --- requests -------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError / PromptTooLongError for a request the model cannot take."""
        validate(request, self.vocab_size, self.max_positions)

    def add_request(self, request: GenerationRequest, abort: AbortHandle | None = None,
                    prefilled: PrefillResult | None = None, collect: bool = False) -> Sequence:
        """Validate `request` and queue it; raises InvalidRequestError (naming the field) for a bad one.
        `abort` (optional) stops it from any thread. `prefilled` skips the prefill (the sequence decodes
        from that cache). `collect` keeps its outputs in `seq.outbox` (callers that drive `step()`)."""
        seq = self._sequence(request, abort, collect)
        self.scheduler.check_fits(seq)
        if prefilled is not None:
            seq.prefill = PrefillProgress(prefilled.cache, in_cache=request.prompt_tokens, logits=prefilled.logits)
            seq.stats = prefilled.stats
        elif self.lookups is not None and looks_up(seq.mode):
            self.lookups.submit(seq)  # queued once its segments are looked up (or its deadline passed), off this thread
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
                        self.eos_ids, max_new, reserved, abort=abort or AbortHandle(), collect=collect,
                        heads=request_heads(request, self.config, seam))

    def set_limits(self, max_running: int, max_step_tokens: int, running_budget_bytes: int) -> None:
        """Replace the scheduler's limits (a gateway applies its settings to an engine it was given).
        Call while no request is in the engine."""
        self.config = dataclasses.replace(self.config, max_running=max_running, max_step_tokens=max_step_tokens,
                                          running_budget_bytes=running_budget_bytes)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.lookups is not None and self.lookups.pending > 0)

    def has_background_work(self) -> bool:
        """Deferred cold work is waiting (`step()` computes it, also with no request in the engine)."""
        return bool(self.cache_manager.pending_background())

    def drain_background(self) -> None:
        """Run steps until no deferred cold work is left (tests, benchmarks: a following request then hits
        the entries; the gateway's engine thread steps while `has_background_work()`)."""
        while self.has_background_work():
            self.step()

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one step (see the module docstring); return what it produced, in no particular order."""
        if self.lookups is not None:  # requests whose lookups are done or past their deadline join the scheduler
            self.lookups.settle(idle=not self.scheduler.has_work())
        with self._lock, torch.inference_mode():
            scheduled = self.scheduler.schedule()
            executed = self.executor.execute(scheduled)
            outputs, kept = self.output.update(scheduled, executed, self.speculator, self._release)
            self.executor.leave(executed, kept)
            try:
                self.executor.background(scheduled, executed)
            except Exception as exc:  # noqa: BLE001 - no request waits for it: drop it, never fail the step
                self.cache_manager.abandon_background(exc)
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
            self.cache_manager.plan(seq)
            if seq.error is not None:
                raise seq.error
            move_cursors(self.executor.prefill(seq), {})
        return PrefillResult(seq.prefill.cache, request.prompt_tokens, seq.prefill.logits, seq.stats)

    def segment_entries(self, segments: tuple[tuple[int, ...], ...], seam: int, salt: str = "") -> EntryLookup:
        """Canonical entries for `segments` under `salt` (misses computed together and stored), with hit flags."""
        return self.cache_manager.segment_entries(segments, seam, salt, self._lock)

    def _release(self, seq: Sequence, out: StepOutput) -> None:
        """Deliver `out`; a sequence that ends with it leaves the engine."""
        if out.finish_reason is not None:
            seq.status, seq.finish_reason = Status.FINISHED, out.finish_reason
            self.cache_manager.release(seq)
            seq.prefill = seq.cache = seq.logits = None
            self.scheduler.finish(seq)
        if seq.collect:
            seq.outbox.append(out)
