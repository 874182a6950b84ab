"""Exact prefix + PIC: the leading context segments (system prompt, earlier turns) are computed
exactly or restored from an exact snapshot; only the segments after them are stitched.
And exact runs: leading documents an earlier request had in the same order are computed exactly
once and then restored, so a repeat equals full prefill; a new order composes.

Invariants, for every supported family:
- the exact part is exact: with every context segment in the exact prefix, a pic mode equals
  full prefill; with a seam covering the stitched segments, too;
- a restored prefix gives the same logits and continuation as computing it;
- documents repeated in the same order equal full prefill (logits and tokens) and count as
  cached; in a shuffled order they still compose;
- the accounting partitions the prompt: exact + composed + seam + fresh = prompt tokens, and a
  restored prefix counts as exact, never as composed.
"""

from __future__ import annotations

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.errors import InvalidRequestError

FAMILIES = ["qwen3_5", "llama", "bamba", "kimi_linear", "minimax", "zamba2"]
LENGTHS = (14, 20, 40, 31, 23, 6)  # system prompt, an earlier turn, three chunks, question


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def engine(family):
    return engines.engine(seam=8, family=family)


def req(segments, mode="hypic", seam=None, exact_prefix=0, max_tokens=5, exact_runs=True):
    return GenerationRequest(tuple(segments), mode=mode, seam=seam, exact_prefix=exact_prefix,
                             sampling=SamplingParams(max_tokens=max_tokens), exact_runs=exact_runs)


def test_everything_exact_equals_full(engine):
    segs = random_segments(LENGTHS, seed=11)
    full = engine.prefill(req(segs, "full")).logits
    for mode in ("hypic", "pic-naive"):
        out = engine.prefill(req(segs, mode, exact_prefix=len(segs) - 1))
        assert (out.logits - full).abs().max().item() <= 1e-4, mode
        assert out.stats.composed_tokens == 0 and out.stats.seam_tokens == 0


def test_wide_seam_after_an_exact_prefix_equals_full(engine):
    segs = random_segments(LENGTHS, seed=12)
    full = engine.prefill(req(segs, "full")).logits
    for exact in (1, 2):
        out = engine.prefill(req(segs, seam=max(LENGTHS), exact_prefix=exact)).logits
        assert (out - full).abs().max().item() <= 1e-4, exact
    assert engine.generated_tokens(req(segs, seam=max(LENGTHS), exact_prefix=2)) == engine.generated_tokens(req(segs, "full"))


def test_a_restored_prefix_equals_computing_it(engine):
    engine.cache_manager.exact_runs = type(engine.exact_runs)(engine.exact_runs.budget_bytes)  # start empty
    segs = random_segments(LENGTHS, seed=13)
    first = engine.prefill(req(segs, exact_prefix=2))
    assert first.stats.exact_tokens == 0 and first.stats.segment_misses >= 2
    again = engine.prefill(req(segs, exact_prefix=2))
    assert again.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]
    assert torch.equal(first.logits, again.logits)
    # a later turn: the same two leading segments, other chunks and question
    later = list(segs[:2]) + list(random_segments((25, 17, 9), seed=14))
    cold = engines.engine(like=engine)  # no snapshot there
    ref = cold.prefill(req(later, exact_prefix=2)).logits
    warm = engine.prefill(req(later, exact_prefix=2))
    assert warm.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]
    assert (warm.logits - ref).abs().max().item() <= 1e-5
    assert engine.generated_tokens(req(later, exact_prefix=2)) == cold.generated_tokens(req(later, exact_prefix=2))


def test_prefix_mode_snapshots_serve_pic_requests(engine):
    """A `prefix` request's snapshot covers its leading segments; a hypic request sharing them restores them."""
    engine.cache_manager.exact_runs = type(engine.exact_runs)(engine.exact_runs.budget_bytes)
    segs = random_segments(LENGTHS, seed=15)
    engine.prefill(req(segs, "prefix"))
    out = engine.prefill(req(segs, exact_prefix=2))
    assert out.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]
    # with exact repeats the snapshot's documents are restored too
    repeats = engines.engine(like=engine, exact_repeats=True)
    repeats.prefill(req(segs, "prefix"))
    assert repeats.prefill(req(segs, exact_prefix=2)).stats.exact_tokens == sum(LENGTHS[:-1])
    assert repeats.prefill(req(segs, exact_prefix=2, exact_runs=False)).stats.exact_tokens == LENGTHS[0] + LENGTHS[1]


def test_accounting_partitions_the_prompt(engine):
    engine.cache_manager.exact_runs = type(engine.exact_runs)(engine.exact_runs.budget_bytes)
    segs = random_segments(LENGTHS, seed=16)
    for mode, exact in (("full", 0), ("prefix", 0), ("prefix", 0), ("hypic", 0), ("hypic", 2), ("hypic", 2), ("pic-naive", 1)):
        s = engine.prefill(req(segs, mode, exact_prefix=exact)).stats
        assert s.exact_tokens + s.composed_tokens + s.seam_tokens + s.fresh_tokens == s.prompt_tokens == sum(LENGTHS)
        assert min(s.exact_tokens, s.composed_tokens, s.seam_tokens, s.fresh_tokens) >= 0
        if mode in ("full",):
            assert s.cached_tokens == 0
        if mode == "prefix":
            assert s.composed_tokens == 0 and s.seam_tokens == 0
    warm = engine.prefill(req(segs, exact_prefix=2)).stats
    assert warm.exact_tokens == LENGTHS[0] + LENGTHS[1]
    assert warm.composed_tokens == sum(n - 8 for n in LENGTHS[2:-1])  # every chunk body from the cache
    assert warm.seam_tokens == 8 * 3 and warm.fresh_tokens == LENGTHS[-1]


def test_documents_repeated_in_order_equal_full(family):
    """The first sighting composes; the repeat computes the run exactly (and snapshots it); from then on
    it is restored: logits and tokens equal full prefill, and `cached_tokens` counts the documents."""
    engine = engines.engine(8, family, exact_repeats=True)
    segs = random_segments(LENGTHS, seed=17)
    full = engine.prefill(req(segs, "full"))
    full_tokens = engine.generated_tokens(req(segs, "full"))
    context = sum(LENGTHS[:-1])
    first = engine.prefill(req(segs, exact_prefix=1))
    assert first.stats.exact_tokens == 0 and first.stats.seam_tokens > 0  # stitched (its entries cold)
    assert (first.logits - full.logits).abs().max().item() > 1e-4  # composed: approximate (else this tests nothing)
    second = engine.prefill(req(segs, exact_prefix=1))  # a repeat: computed exactly, in context
    assert second.stats.exact_tokens == LENGTHS[0] and second.stats.composed_tokens == second.stats.seam_tokens == 0
    assert (second.logits - full.logits).abs().max().item() <= 1e-4
    third = engine.prefill(req(segs, exact_prefix=1))  # restored
    assert third.stats.cached_tokens == third.stats.exact_tokens == context
    assert third.stats.composed_tokens == third.stats.seam_tokens == 0 and third.stats.fresh_tokens == LENGTHS[-1]
    assert (third.logits - full.logits).abs().max().item() <= 1e-4
    assert engine.generated_tokens(req(segs, exact_prefix=1)) == full_tokens
    # a longer context sharing the run: the run restored, the new document stitched after it
    longer = [*segs[:-1], *random_segments((27, 9), seed=18)]
    out = engine.prefill(req(longer, exact_prefix=1)).stats
    assert out.exact_tokens == context and out.seam_tokens == 8 and out.segment_misses == 1  # stitched after it


def test_documents_in_a_new_order_still_compose(family):
    engine = engines.engine(8, family, exact_repeats=True)
    segs = random_segments(LENGTHS, seed=19)
    for _ in range(2):
        engine.prefill(req(segs, exact_prefix=1))
    shuffled = [segs[0], segs[4], segs[2], segs[1], segs[3], segs[5]]  # a new first document
    out = engine.prefill(req(shuffled, exact_prefix=1))
    assert out.stats.exact_tokens == LENGTHS[0]
    assert out.stats.composed_tokens == sum(n - 8 for n in LENGTHS[1:-1]) and out.stats.segment_misses == 0
    full = engine.prefill(req(shuffled, "full")).logits
    assert (out.logits - full).abs().max().item() > 1e-4  # composed, not restored
    # opting out (the accuracy guard): a repeated run composes, and is not counted as seen
    opted = engines.engine(8, family, exact_repeats=True)
    a, b = (opted.prefill(req(segs, exact_prefix=1, exact_runs=False)) for _ in range(2))
    assert torch.equal(a.logits, b.logits) and b.stats.exact_tokens == LENGTHS[0] and b.stats.composed_tokens > 0
    assert opted.prefill(req(segs, exact_prefix=1)).stats.composed_tokens > 0  # its first sighting


def test_exact_repeats_off_keeps_cold_and_warm_identical(family):
    engine = engines.engine(8, family, exact_repeats=False)
    segs = random_segments(LENGTHS, seed=20)
    a, b = (engine.prefill(req(segs, exact_prefix=1)) for _ in range(2))
    assert torch.equal(a.logits, b.logits) and b.stats.exact_tokens == LENGTHS[0] and b.stats.composed_tokens > 0


def test_exact_prefix_is_validated():
    with pytest.raises(InvalidRequestError, match="exact_prefix"):
        GenerationRequest(((1, 2), (3,)), exact_prefix=2)
