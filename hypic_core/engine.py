"""The engine: a request's life from token-id segments to a stream of sampled tokens.

1. Validate the request (nothing is computed or cached for a bad one).
2. Prefill by mode: `full` one forward; `prefix` longest exact snapshot + the rest;
   `pic-naive` / `hypic`: look up every context segment's canonical entry, compute the
   misses together in one batch, store them, then stitch (DESIGN section 4).
3. Run the question, sample, decode token by token on the same cache.

The engine serialises model calls with one lock held per prefill and per decode step, so
several streaming requests on different threads interleave token by token.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .adapters import adapter_for
from .config import EngineConfig, GenerationRequest, Mode
from .detokenizer import StreamDetokenizer
from .entry import SegmentEntry
from .errors import InvalidRequestError, PromptTooLongError, RequestAborted
from .keys import SegmentKey, model_fingerprint
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache, PrefixSnapshot, chain_hashes
from .sampling import Sampler
from .store import MemorySegmentStore, SegmentStore


class AbortHandle:
    """Set from any thread to stop a request; the engine checks it between model calls."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def abort(self) -> None:
        self._event.set()

    @property
    def aborted(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise RequestAborted("request aborted")


@dataclass
class PrefillStats:
    mode: str
    seam: int
    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens whose work came from a cache (segment bodies, exact prefixes)
    seam_tokens: int = 0  # seam-head tokens recomputed in context
    computed_tokens: int = 0  # tokens run through the model for this request (cold + seams + question)
    segment_hits: int = 0
    segment_misses: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class PrefillResult:
    cache: object
    position: int  # next free position
    logits: torch.Tensor  # first-token logits, fp32
    stats: PrefillStats


@dataclass(frozen=True)
class StepEvent:
    """One generated token. `text` is the newly safe text (may be empty); the last event has finish_reason."""

    index: int
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort"


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 store: SegmentStore | None = None, model_id: str = "model"):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.runner = ModelRunner(model, self.adapter, pad_token_id=pad or 0)
        self.store = store if store is not None else MemorySegmentStore(self.config.memory_budget_bytes)
        self.prefix_cache = PrefixCache(self.config.prefix_budget_bytes)
        self.model_id = model_id
        self.fingerprint = model_fingerprint(model, model_id, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_ids = _eos_ids(model, tokenizer)
        self._lock = threading.RLock()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, store: SegmentStore | None = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> "Engine":
        """Load a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer) onto `device`. Offline only."""
        from .loader import load_local

        model, tokenizer = load_local(path, dtype=dtype)
        model = model.to(device)
        return cls(model, tokenizer, config, store, model_id=Path(path).name)

    @property
    def max_positions(self) -> int:
        return self.adapter.max_positions

    # --- validation ---------------------------------------------------------------------
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

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, request: GenerationRequest, abort: AbortHandle | None = None) -> PrefillResult:
        self.validate(request)
        seam = self.config.seam if request.seam is None else request.seam
        stats = PrefillStats(request.mode.value, seam, prompt_tokens=request.prompt_tokens)
        t0 = time.perf_counter()
        with self._lock, torch.inference_mode():
            if request.mode is Mode.FULL:
                cache, pos = self.runner.new_cache(), 0
                ids = [t for seg in request.segments for t in seg]
                logits = self.runner.forward(ids, 0, cache, logits=True)
                stats.computed_tokens = len(ids)
                pos = len(ids)
            elif request.mode is Mode.PREFIX:
                cache, pos = self._prefill_prefix(request, stats, abort)
                _check(abort)
                t = time.perf_counter()
                logits = self.runner.forward(request.question, pos, cache, logits=True)
                stats.timings_ms["question"] = _ms(t)
                stats.computed_tokens += len(request.question)
                pos += len(request.question)
            else:
                cache, pos, logits = self._prefill_stitched(request, seam, stats, abort)
        stats.timings_ms["prefill"] = _ms(t0)
        return PrefillResult(cache, pos, logits, stats)

    def segment_entries(self, segments: tuple[tuple[int, ...], ...], seam: int,
                        stats: PrefillStats | None = None) -> tuple[list[SegmentEntry], list[bool]]:
        """Canonical entries for `segments` and whether each was a store hit.

        Misses are computed together (batched) and inserted into the store.
        """
        keys = [SegmentKey.of(self.fingerprint, seam, s) for s in segments]
        t = time.perf_counter()
        found = [self.store.lookup(k, s) for k, s in zip(keys, segments)]
        hits = [e is not None for e in found]
        missing: dict[tuple[int, ...], list[int]] = {}
        for i, e in enumerate(found):
            if e is None:
                missing.setdefault(segments[i], []).append(i)  # duplicate segments computed once
        if stats is not None:
            stats.timings_ms["lookup"] = _ms(t)
            stats.segment_hits = len(segments) - sum(len(v) for v in missing.values())
            stats.segment_misses = len(segments) - stats.segment_hits
        if missing:
            t = time.perf_counter()
            todo = list(missing)
            with self._lock, torch.inference_mode():
                computed = self.runner.compute_entries(todo, seam, self.config.max_cold_batch_tokens)
            for seg, entry in zip(todo, computed):
                for i in missing[seg]:
                    found[i] = entry
                self.store.insert(keys[missing[seg][0]], entry)
            if stats is not None:
                stats.timings_ms["cold"] = _ms(t)
                stats.computed_tokens += sum(len(s) for s in todo)
        return found, hits  # type: ignore[return-value]

    def _prefill_stitched(self, request: GenerationRequest, seam: int, stats: PrefillStats, abort):
        entries, hits = self.segment_entries(request.context, seam, stats)
        stats.cached_tokens = sum(e.body_length for e, hit in zip(entries, hits) if hit)
        stats.seam_tokens = sum(e.seam for e in entries)
        stats.computed_tokens += stats.seam_tokens + len(request.question)
        _check(abort)
        t = time.perf_counter()
        cache = self.runner.new_cache()
        logits = self.runner.stitch(cache, request.context, entries, request.question, compose=request.mode is Mode.HYPIC)
        stats.timings_ms["stitch"] = _ms(t)
        return cache, request.prompt_tokens, logits

    def _prefill_prefix(self, request: GenerationRequest, stats: PrefillStats, abort):
        digests = [SegmentKey.of(self.fingerprint, 0, s).tokens for s in request.context]
        chain = chain_hashes(digests)
        t = time.perf_counter()
        snap, n = self.prefix_cache.longest(chain)
        cache = self.runner.new_cache()
        pos = 0
        if snap is not None:
            pos = snap.boundaries[n - 1]
            self._restore(cache, snap, n)
            stats.cached_tokens = pos
            stats.segment_hits = n
        stats.segment_misses = len(request.context) - n
        boundaries = list(snap.boundaries[:n]) if snap else []
        linear = list(snap.linear[:n]) if snap else []
        for seg in request.context[n:]:
            _check(abort)
            self.runner.forward(seg, pos, cache)
            pos += len(seg)
            stats.computed_tokens += len(seg)
            boundaries.append(pos)
            linear.append(self._linear_snapshot(cache))
        if n < len(request.context):
            a = self.adapter.attention_layers
            self.prefix_cache.insert(chain, PrefixSnapshot(
                tuple(cache.layers[i].keys[0].clone() for i in a),
                tuple(cache.layers[i].values[0].clone() for i in a),
                tuple(boundaries), tuple(linear)))
        stats.timings_ms["stitch"] = _ms(t)
        return cache, pos

    def _linear_snapshot(self, cache):
        return tuple(tuple(x.clone() for x in self.adapter.read_linear_state(cache, p))
                     for p in range(len(self.adapter.linear_layers)))

    def _restore(self, cache, snap: PrefixSnapshot, n: int) -> None:
        upto = snap.boundaries[n - 1]
        for j, i in enumerate(self.adapter.attention_layers):
            cache.update(snap.keys[j][None, :, :upto].clone(), snap.values[j][None, :, :upto].clone(), i)
        for p, (conv, state) in enumerate(snap.linear[n - 1]):
            self.adapter.read_linear_state(cache, p)
            self.adapter.write_linear_state(cache, p, conv, state)

    # --- generation ---------------------------------------------------------------------
    def generate(self, request: GenerationRequest, abort: AbortHandle | None = None,
                 prefilled: PrefillResult | None = None) -> Iterator[StepEvent]:
        """Prefill (unless given) and decode, yielding one StepEvent per token; the last has finish_reason.

        Stops on an EOS token, a stop string, max_tokens, the end of the model's context, or
        `abort` (finish_reason "abort"). Raises the engine's errors for a bad request before
        yielding anything.
        """
        params = request.sampling
        sampler = Sampler(params)
        detok = StreamDetokenizer(self.tokenizer, params.stop)
        try:
            result = prefilled or self.prefill(request, abort)
        except RequestAborted:
            yield StepEvent(0, None, "", finish_reason="abort")
            return
        cache, pos, logits = result.cache, result.position, result.logits
        limit = min(params.max_tokens, self.max_positions - pos)
        for index in range(limit):
            if abort is not None and abort.aborted:
                yield StepEvent(index, None, detok.flush(), finish_reason="abort")
                return
            choice = sampler(logits)
            if choice.token_id in self.eos_ids:
                yield StepEvent(index, choice.token_id, detok.flush(), choice.logprob, choice.top_logprobs, "stop")
                return
            text = detok.push(choice.token_id)
            if detok.stopped:
                yield StepEvent(index, choice.token_id, text, choice.logprob, choice.top_logprobs, "stop")
                return
            if index == limit - 1:
                yield StepEvent(index, choice.token_id, text + detok.flush(), choice.logprob, choice.top_logprobs, "length")
                return
            yield StepEvent(index, choice.token_id, text, choice.logprob, choice.top_logprobs)
            with self._lock, torch.inference_mode():
                logits = self.runner.forward([choice.token_id], pos, cache, logits=True)
            pos += 1
        yield StepEvent(0, None, detok.flush(), finish_reason="length")

    def generated_tokens(self, request: GenerationRequest) -> list[int]:
        """Every generated token id, EOS excluded (tests, evaluation)."""
        return [e.token_id for e in self.generate(request) if e.token_id is not None and e.token_id not in self.eos_ids]


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _check(abort: AbortHandle | None) -> None:
    if abort is not None:
        abort.check()


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)
