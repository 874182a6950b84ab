"""Prefill strategies: how a request's prompt is laid out as work, one class per way of reusing the cache.

A strategy answers one question, `plan(context, seq, progress)`: which runs, cold entries and
stitch make up this sequence's prefill (hypic_core/engine/sequence.py `PrefillProgress`), asking the
context-cache manager for what is cached. The engine then executes any progress the same way
(cold entries, runs, the stitch). `strategy_for(mode)` picks one.
"""

from __future__ import annotations

from typing import Protocol

from ..config import Mode
from .sequence import PrefillProgress, Run, Sequence


class PrefillStrategy(Protocol):
    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        """Fill `progress` (mutated) for `seq`; `context` is the `ContextCacheManager`."""


class FullPrefill:
    """No cache: one run over the whole prompt (what HF `generate` does)."""

    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        progress.runs.append(Run(tuple(t for s in seq.request.segments for t in s), 0))
        progress.timing = "forward"


class PrefixPrefill:
    """Exact prefix reuse only (what vLLM / SGLang offer for hybrids): the longest run of leading
    segments a snapshot holds is restored, the rest of the context runs exactly and is kept."""

    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        request = seq.request
        pos = context.exact_run(seq, progress, len(request.context), longer=False)
        progress.runs.append(Run(request.question, pos))


class StitchedPrefill:
    """`hypic` / `pic-naive`: an exact run of leading segments (restored or computed), then every other
    context segment's canonical entry (looked up, or computed as cold work) stitched with its seam
    head recomputed in context, then the question."""

    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        request = seq.request
        longer = request.exact_runs and context.config.exact_repeats
        progress.start = context.exact_run(seq, progress, request.exact_prefix, longer=longer)
        context.entries(seq, progress, progress.exact)
        progress.stitch_pending = True
        seq.stats.seam_tokens = sum(min(seq.seam, len(s)) for s in request.context[progress.exact:])


STRATEGIES: dict[Mode, PrefillStrategy] = {Mode.FULL: FullPrefill(), Mode.PREFIX: PrefixPrefill(),
                                           Mode.PIC_NAIVE: StitchedPrefill(), Mode.HYPIC: StitchedPrefill()}


def strategy_for(mode: Mode) -> PrefillStrategy:
    return STRATEGIES[mode]
