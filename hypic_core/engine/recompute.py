"""Query-aware selective recompute (issue 49, rung 3): how wide each stitched segment's seam head is.

A stitched segment recomputes its seam head (its first w tokens) in context and reuses the rest
(its body: attention K/V and, on a hybrid, the linear layers' body operators (T, E)). On a hybrid
an arbitrary scattered set of reused tokens cannot be recomputed alone: a linear layer's state at
a token folds in every token before it, so recomputing token t in context changes the inputs of
every later token of the segment, and the cached body operator (a function of the canonical
inputs) no longer applies after it. What can be recomputed exactly and cheaply is a segment's
*leading* span: the seam head, run through all layers on top of everything before it, with the
body operator of the rest composed after it, S <- T S + E. A head as wide as the segment is the
segment computed in context (no entry used, exact given what precedes it).

So the recompute budget is spent as seam width: `head_widths` gives every stitched segment its
usual head (`EngineConfig.head_width`), then spends ceil(ratio x the tokens the usual heads
reuse) extra tokens on the segments the question needs most, in `priority` order, each widened
up to its whole length. The default priority is the prompt order read backwards: the gateway's
prompter puts the best-scoring document next to the question, so the nearest segment is the
highest-ranked one (and the one whose in-context tokens the question reads last, as
Tail-Replay recomputes the context's tail). A widened head is cut at a multiple of `quantum`
tokens (or the whole segment), so a segment's entries come in few widths and stay cached across
requests.

It is wired as `EngineConfig.recompute_ratio` (the gateway's `HYPIC_RECOMPUTE_RATIO`, 0 by default: the
accuracy ladder's runs did not earn it a place in the default, docs/accuracy.md "Rung 3") and a
request's `recompute`; `request_heads` gives a sequence's widths, which the cache manager's `head`
reads. The accuracy guard widens with it (app/service/guard.py).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..config import EngineConfig, GenerationRequest, Mode
from .plan import leading_exact


def head_widths(lengths: Sequence[int], base: Sequence[int], ratio: float, priority: Sequence[int] | None = None,
                quantum: int = 16) -> tuple[int, ...]:
    """Seam head of each stitched segment under a recompute budget. Pure; raises ValueError on bad input.

    lengths: every stitched segment's token count, in prompt order.
    base: the head each gets without the budget (`EngineConfig.head_width`), any value >= 0
        (a head is at most its segment: min with the length).
    ratio: the budget, as a share of the tokens the base heads leave reused: ceil(ratio x
        sum(length - base head)) extra tokens at most.
    priority: segment indices in the order they receive the budget (default: the last first).
    quantum: a widened head is a multiple of `quantum` tokens, or the whole segment; what a
        segment cannot use of the budget passes to the next one.

    Returns one width per segment, each in [min(base, length), length].
    """
    if len(base) != len(lengths):
        raise ValueError(f"base has {len(base)} widths for {len(lengths)} segments")
    if not 0.0 <= ratio <= 1.0:  # NaN fails too
        raise ValueError(f"ratio must be in [0, 1], got {ratio!r}")
    if quantum < 1:
        raise ValueError(f"quantum must be >= 1, got {quantum}")
    widths = [min(max(0, b), n) for b, n in zip(base, lengths)]
    order = list(range(len(lengths)))[::-1] if priority is None else list(priority)
    if sorted(order) != list(range(len(lengths))):
        raise ValueError(f"priority must order every segment index once, got {list(order)}")
    left = math.ceil(ratio * sum(n - w for n, w in zip(lengths, widths)) - 1e-9)
    for i in order:
        if left <= 0:
            break
        n, w = lengths[i], widths[i]
        if n - w <= left:
            new = n  # the whole segment in context
        else:
            new = (w + left) // quantum * quantum
            if new <= w:
                continue  # too little left for this one's next step: the next segment may still use it
        left -= new - w
        widths[i] = new
    return tuple(widths)


def request_heads(request: GenerationRequest, config: EngineConfig, seam: int) -> dict[tuple[int, ...], int] | None:
    """The seam head of each of `request`'s stitched context segments under its recompute budget
    (`request.recompute`, else `config.recompute_ratio`), or None when there is no budget to spend
    (then every segment gets `config.head_width`). The budget is spread over the segments the planner
    may stitch (after the request's exact prefix), nearest the question first; a segment that occurs
    twice keeps the width of its later place (the nearer one, widened first). Heads are part of the entries' keys, so a widened
    segment's entry is computed (and cached) at that width."""
    ratio = config.recompute_ratio if request.recompute is None else request.recompute
    if ratio <= 0.0 or request.mode not in (Mode.HYPIC, Mode.PIC_NAIVE):
        return None
    segments = request.context[leading_exact(request, config):]  # the segments the planner may stitch
    if not segments:
        return None
    widths = head_widths([len(s) for s in segments], [config.head_width(seam, len(s)) for s in segments], ratio)
    return dict(zip(segments, widths))
