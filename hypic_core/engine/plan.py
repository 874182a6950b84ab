"""The planner: a request and what the cache holds in, a frozen `Plan` out; pure, one function per mode.

`make_plan(request, view)` asks `view` (a `CacheView`: the cache manager's read-only window on one
sequence, or a fake in tests) what is cached, and decides, changing nothing:

- `full`: one run over the whole prompt;
- `prefix`: the longest run of leading context segments a snapshot holds is restored, the rest of
  the context runs exactly (kept as a snapshot), then the question;
- `hypic` / `pic-naive`: an exact run of leading segments (at least `exact_prefix`, the first one
  with an entry prefix; with exact repeats as many as a snapshot holds, and those an earlier
  request had in this order unless the cost model finds composing them cheaper: `repeats`), then
  every other context segment's canonical entry (a hit, or a miss to compute) stitched with its
  seam head recomputed in context, then the question. A cold request
  (`EngineConfig.cold_prefill`: every entry missing, or the cost model's choice) runs the rest of
  its prompt as ONE exact forward instead, its missing entries deferred.

The cache manager carries a plan out (restores the snapshot, queues the runs, registers the misses
as entry jobs). Each stitched segment's seam head comes from `view.head` (CacheManager.head), the
one place where per-segment seam widths are decided.

`CostModel` estimates a prefill's model work, so that a stitched request can be served by one
exact forward when its cold work would cost more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence as Seq

import torch

from ..algebra.entry import SegmentEntry
from ..config import EngineConfig, GenerationRequest, Mode


@dataclass(frozen=True)
class RunHit:
    """What the snapshots hold of a run of leading segments."""

    snapshot: Any  # the longest snapshot found (None: none)
    restored: int  # leading segments it holds (0 when none)
    seen: int  # leading segments an earlier request had in this order (0 when no snapshot can be kept)


class CacheView(Protocol):
    """What the planner may ask of the cache about one sequence (reads only)."""

    config: EngineConfig
    cost: "CostModel | None"
    workers: int  # processes cold entries are computed on

    def longest_run(self, segments: Seq[tuple[int, ...]]) -> RunHit:
        """The snapshots' longest hit on `segments` as leading context segments."""

    def find(self, first: int) -> list[SegmentEntry | None]:
        """The stored entries of the context segments `first`.. (None before `first` and for a miss)."""

    def head(self, segment: tuple[int, ...]) -> int:
        """The seam head `segment` gets (its entry's key depends on it)."""

    def in_flight(self, segment: tuple[int, ...]) -> tuple[int, bool] | None:
        """Entry work under way for `segment` (tokens computed, finished), or None."""


@dataclass(frozen=True)
class Plan:
    """How one sequence's prompt is prefilled. Context segments [0, exact) are done exactly: [0,
    restored) restored from `snapshot`, the rest run with their boundaries kept; then either the
    question (`prefix`), one exact forward over the rest (`forward`), or the stitched segments
    [exact, n) (`stitch`): `found[i]` a hit, else a miss computed as an entry; `heads` their seam heads."""

    rest: str  # "whole" (full), "question" (prefix), "stitch" or "forward"
    exact: int = 0
    restored: int = 0
    snapshot: Any = None
    see: bool = False  # record this order's sighting (exact repeats)
    found: tuple[SegmentEntry | None, ...] = ()  # one per context segment (None before `exact`, and misses)
    heads: tuple[int, ...] = ()  # one per context segment from `exact`
    transition: bool = True  # stitched bodies advance linear states by T S + E (hypic), else S + E (pic-naive)

    @property
    def misses(self) -> list[int]:
        """Stitched (or deferred) context segments with no stored entry."""
        return [i for i in range(self.exact, len(self.found)) if self.found[i] is None]


def plan_full(request: GenerationRequest, view: CacheView) -> Plan:
    return Plan("whole")


def plan_prefix(request: GenerationRequest, view: CacheView) -> Plan:
    hit = view.longest_run(request.context) if request.context else RunHit(None, 0, 0)
    return Plan("question", exact=len(request.context), restored=hit.restored, snapshot=hit.snapshot)


def leading_exact(request: GenerationRequest, config: EngineConfig) -> int:
    """Leading context segments a stitched plan computes exactly whatever the cache holds: the request's
    exact prefix and, with an entry prefix, at least the first (it sits after nothing)."""
    return max(request.exact_prefix, 1) if config.entry_prefix and request.context else request.exact_prefix


def plan_stitched(request: GenerationRequest, view: CacheView) -> Plan:
    config = view.config
    longer = request.exact_runs and config.exact_repeats
    exact = leading_exact(request, config)
    considered = request.context if longer else request.context[:exact]
    hit = view.longest_run(considered) if considered else RunHit(None, 0, 0)
    see = bool(considered) and longer and request.cache_store
    exact, seen = max(exact, hit.restored), (hit.seen if see else 0)
    if view.config.repeats == "exact" or view.cost is None:  # no choice to make: the run is computed
        exact = max(exact, seen)
    found = view.find(exact)
    heads = [view.head(s) for s in request.context[exact:]]
    if seen > exact and repeat_runs_exactly(request, view, exact, seen, found, heads):
        found = [None] * seen + found[seen:]
        heads, exact = heads[seen - exact:], seen
    found, heads = tuple(found), tuple(heads)
    rest = "forward" if exact_forward_wins(request, view, exact, found, heads) else "stitch"
    return Plan(rest, exact, hit.restored, hit.snapshot, see, found, heads, transition=request.mode is Mode.HYPIC)


PLANNERS: dict[Mode, Callable[[GenerationRequest, CacheView], Plan]] = {
    Mode.FULL: plan_full, Mode.PREFIX: plan_prefix, Mode.PIC_NAIVE: plan_stitched, Mode.HYPIC: plan_stitched}


def make_plan(request: GenerationRequest, view: CacheView) -> Plan:
    """`request`'s plan with the cache as `view` shows it (see the module docstring)."""
    return PLANNERS[request.mode](request, view)


def looks_up(mode: Mode) -> bool:
    """Whether `mode`'s plan looks its context segments up in the segment store."""
    return PLANNERS[mode] is plan_stitched


def exact_forward_wins(request: GenerationRequest, view: CacheView, exact: int, found: Seq[SegmentEntry | None],
                       heads: Seq[int]) -> bool:
    """Whether a stitched request runs the rest of its prompt after its exact run as one exact forward
    instead of cold entries and the stitch (`EngineConfig.cold_prefill`): "exact" when every
    stitched segment misses; "auto" when the cost model says the cold work (the misses, less what is
    computed of them already) and the stitch cost more. Never for a request that measures
    composition (`exact_runs` False: the accuracy guard's)."""
    choice = view.config.cold_prefill
    stitched = found[exact:]
    if choice == "stitch" or not request.exact_runs or not stitched or all(e is not None for e in stitched):
        return False
    if choice == "exact":
        return all(e is None for e in stitched)
    if view.cost is None:
        return False
    start = sum(len(s) for s in request.context[:exact])
    return exact_wins(view.cost, start, request.prompt_tokens, cold_work(request, view, exact, found, heads),
                      stitch_tokens(request, exact, heads), view.workers)


def repeat_runs_exactly(request: GenerationRequest, view: CacheView, exact: int, seen: int,
                        found: Seq[SegmentEntry | None], heads: Seq[int]) -> bool:
    """Whether context segments [exact, seen), which an earlier request had in this order and no snapshot
    holds, run exactly now (kept as a snapshot, restored from the next repeat on) rather than composed
    (`EngineConfig.repeats` "cheaper"): when the cost model puts that run's forward, and
    the stitch after it, at no more than composing from `exact` (their entries, what is missing of them,
    and their seam heads in the stitch). `found` and `heads` are from `exact` on, as the planner looked
    them up (plan_stitched asks only under "cheaper" with a cost model: otherwise the run is computed
    and its entries are not looked up)."""
    cost = view.cost
    start = sum(len(s) for s in request.context[:exact])
    run = sum(len(s) for s in request.context[exact:seen])
    later = list(heads[seen - exact:])
    computed = (cost.forward(run, start) + cold_cost(cost, cold_work(request, view, seen, found, later), view.workers)
                + cost.stitch(stitch_tokens(request, seen, later), request.prompt_tokens))
    composed = (cold_cost(cost, cold_work(request, view, exact, found, heads), view.workers)
                + cost.stitch(stitch_tokens(request, exact, heads), request.prompt_tokens))
    return computed <= composed


def cold_work(request: GenerationRequest, view: CacheView, exact: int, found: Seq[SegmentEntry | None],
              heads: Seq[int]) -> list[tuple[int, int]]:
    """(length, tokens computed already) of each distinct missing entry of the stitched segments
    [exact, n) (`heads`: theirs, from `exact`)."""
    cold: dict[tuple[int, ...], tuple[int, int]] = {}
    for seg, entry, head in zip(request.context[exact:], found[exact:], heads):
        if entry is None:
            work = view.in_flight(seg)
            done = 0 if work is None else len(seg) if work[1] else work[0]
            cold[(head, *seg)] = (len(seg), done)
    return list(cold.values())


def stitch_tokens(request: GenerationRequest, exact: int, heads: Seq[int]) -> int:
    """Tokens of the stitch forward after an exact run of `exact` segments: the seam heads and the question."""
    return sum(min(h, len(s)) for h, s in zip(heads, request.context[exact:])) + len(request.question)


def cold_cost(cost: "CostModel", cold: Seq[tuple[int, int]], workers: int = 1) -> float:
    """Computing the missing entries `cold` ((length, done) each), shared by `workers` processes."""
    return sum(cost.entry(n, d) for n, d in cold) / max(1, workers)


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
    return cold_cost(cost, cold, workers) + cost.stitch(stitched, prompt_tokens) > STITCH_MARGIN * cost.forward(prompt_tokens - start, start)
