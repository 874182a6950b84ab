"""Prefill strategies: how a request's prompt is laid out as work, one class per way of reusing the cache.

A strategy answers one question, `plan(context, seq, progress)`: which runs, cold entries and
stitch make up this sequence's prefill (hypic_core/engine/sequence.py `PrefillProgress`), asking the
cache manager for what is cached. The engine then executes any progress the same way
(cold entries, runs, the stitch). `strategy_for(mode)` picks one.

`CostModel` estimates a prefill's model work, so that a stitched request can be served by one
exact forward when its cold work would cost more (`EngineConfig.cold_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import torch

from ..config import Mode
from .sequence import PrefillProgress, Run, Sequence


class PrefillStrategy(Protocol):
    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        """Fill `progress` (mutated) for `seq`; `context` is the `CacheManager`."""


@dataclass(frozen=True)
class CostModel:
    """Model work, in units of one token through the weights (2 FLOPs per per-token parameter).

    A token at position p of a forward costs 1 + attention * p (its queries against p keys in every
    attention layer); a token of a canonical entry also costs `entry_overhead` (its linear layers'
    body operators T, E, computed beside the forward) but attends only within its segment. So a
    cold request computed as entries skips the cross-segment attention and pays the transitions;
    `full` pays the attention. An estimate to choose between the two, not a timing.
    """

    attention: float  # work per (query, key) pair, summed over the attention layers
    entry_overhead: float  # extra work per token of a canonical entry

    @classmethod
    def of(cls, model: torch.nn.Module, adapter, state_elements: int) -> "CostModel":
        """From the model's shapes: 4 h d FLOPs per (query, key) pair per attention layer (q K^T and
        p V, h heads of width d), against 2 per per-token parameter (embeddings excluded, routed
        experts counted at top-k / experts); the entry overhead is the adapter's `entry_state_cost`
        times the linear state's elements (`state_elements`, one sequence) over those parameters."""
        params = per_token_parameters(model)
        cfg = model.config
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        width = int(getattr(cfg, "head_dim", 0) or (cfg.hidden_size // heads if heads else 0))
        attention = 2.0 * heads * width * len(adapter.attention_layers) / params
        return cls(attention, adapter.entry_state_cost * state_elements / params)

    def forward(self, n: int, start: int = 0) -> float:
        """`n` tokens run at positions start.. over a cache holding the `start` before them."""
        return n + self.attention * n * (start + (n + 1) / 2)

    def entry(self, length: int, done: int = 0) -> float:
        """What is left of a canonical entry of `length` tokens, `done` of them computed already."""
        n = length - done
        return n * (1 + self.entry_overhead) + self.attention * n * (done + (n + 1) / 2)

    def stitch(self, n: int, keys: int) -> float:
        """One stitch forward: `n` tokens (seam heads and the question) attending to up to `keys`."""
        return n + self.attention * n * keys


def per_token_parameters(model: torch.nn.Module) -> float:
    """Parameters a token goes through: all but the embeddings and the output head (the prefill keeps
    one position's logits), routed experts counted at num_experts_per_tok / num_experts."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    cfg = model.config
    k = getattr(cfg, "num_experts_per_tok", None)
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
    share = k / n if k and n else 1.0
    total = sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters()
                if id(p) not in skip)
    return max(float(total), 1.0)


# The stitched cold path is chosen only when estimated at most this share of the exact forward: the
# exact forward is `full` by construction (and its answer exact), the estimate is within a few
# percent of measured timings (docs/benchmarks.md, "Cold"), so a near tie goes to the exact forward.
STITCH_MARGIN = 0.9


def exact_wins(cost: CostModel, start: int, prompt_tokens: int, cold: Seq[tuple[int, int]], stitched: int,
               workers: int = 1) -> bool:
    """Whether one exact forward over the prompt after `start` is the cheaper choice against computing
    the cold entries (`cold`: (length, done) of each missing one, shared by `workers` processes) and
    then stitching `stitched` tokens (seam heads and the question) over the whole prompt; the stitch
    has to be estimated under STITCH_MARGIN of the forward to win."""
    entries = sum(cost.entry(n, d) for n, d in cold) / max(1, workers)
    return entries + cost.stitch(stitched, prompt_tokens) > STITCH_MARGIN * cost.forward(prompt_tokens - start, start)


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
    head recomputed in context, then the question. A cold request (`EngineConfig.cold_prefill`:
    every entry missing, or the cost model's choice) runs the rest of its prompt exactly instead.
    With an entry prefix (`EngineConfig.entry_prefix`) the first context segment is always in the
    exact run: it sits after nothing, and entries are computed as segments sit after the prefix."""

    def plan(self, context, seq: Sequence, progress: PrefillProgress) -> None:
        request = seq.request
        longer = request.exact_runs and context.config.exact_repeats
        n_exact = request.exact_prefix
        if context.config.entry_prefix and request.context:
            n_exact = max(n_exact, 1)
        progress.start = context.exact_run(seq, progress, n_exact, longer=longer)
        found = context.lookup(seq, progress.exact)
        if context.exact_forward_wins(seq, progress, found):
            # Cold: ONE exact forward over the rest of the prompt, as `full` runs it (its answer);
            # the missing entries are computed after its first token (CacheManager.defer).
            context.exact_rest(seq, progress, found)
            return
        context.entries(seq, progress, found)
        progress.stitch_pending = True
        seq.stats.seam_tokens = sum(min(context.head(seq, s), len(s)) for s in request.context[progress.exact:])


STRATEGIES: dict[Mode, PrefillStrategy] = {Mode.FULL: FullPrefill(), Mode.PREFIX: PrefixPrefill(),
                                           Mode.PIC_NAIVE: StitchedPrefill(), Mode.HYPIC: StitchedPrefill()}


def strategy_for(mode: Mode) -> PrefillStrategy:
    return STRATEGIES[mode]


def looks_up(mode: Mode) -> bool:
    """Whether `mode`'s layout looks its context segments up in the segment store."""
    return isinstance(STRATEGIES[mode], StitchedPrefill)
