"""Exact prefix + PIC: the leading context segments (system prompt, earlier turns) are computed
exactly or restored from an exact prefix snapshot; only the segments after them are stitched.

Invariants, for every supported family:
- the exact part is exact: with every context segment in the exact prefix, a pic mode equals
  full prefill; with a seam covering the stitched segments, too;
- a restored prefix gives the same logits and continuation as computing it;
- the accounting partitions the prompt: exact + composed + seam + fresh = prompt tokens, and a
  restored prefix counts as exact, never as composed.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine import Engine
from hypic_core.errors import InvalidRequestError
from hypic_core.testing import tiny_model

FAMILIES = ["qwen3_5", "llama", "bamba", "kimi_linear", "minimax", "zamba2"]
LENGTHS = (14, 20, 40, 31, 23, 6)  # system prompt, an earlier turn, three chunks, question


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request):
    return Engine(tiny_model(request.param), config=EngineConfig(seam=8))


def req(segments, mode="hypic", seam=None, exact_prefix=0, max_tokens=5):
    return GenerationRequest(tuple(segments), mode=mode, seam=seam, exact_prefix=exact_prefix,
                             sampling=SamplingParams(max_tokens=max_tokens))


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
    engine.prefix_cache = type(engine.prefix_cache)(engine.prefix_cache.budget_bytes)  # start empty
    segs = random_segments(LENGTHS, seed=13)
    first = engine.prefill(req(segs, exact_prefix=2))
    assert first.stats.exact_tokens == 0 and first.stats.segment_misses >= 2
    again = engine.prefill(req(segs, exact_prefix=2))
    assert again.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]
    assert torch.equal(first.logits, again.logits)
    # a later turn: the same two leading segments, other chunks and question
    later = list(segs[:2]) + list(random_segments((25, 17, 9), seed=14))
    cold = Engine(engine.model, config=EngineConfig(seam=8))  # no snapshot there
    ref = cold.prefill(req(later, exact_prefix=2)).logits
    warm = engine.prefill(req(later, exact_prefix=2))
    assert warm.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]
    assert (warm.logits - ref).abs().max().item() <= 1e-5
    assert engine.generated_tokens(req(later, exact_prefix=2)) == cold.generated_tokens(req(later, exact_prefix=2))


def test_prefix_mode_snapshots_serve_pic_requests(engine):
    """A `prefix` request's snapshot covers its leading segments; a hypic request sharing them restores them."""
    engine.prefix_cache = type(engine.prefix_cache)(engine.prefix_cache.budget_bytes)
    segs = random_segments(LENGTHS, seed=15)
    engine.prefill(req(segs, "prefix"))
    out = engine.prefill(req(segs, exact_prefix=2))
    assert out.stats.exact_tokens == LENGTHS[0] + LENGTHS[1]


def test_accounting_partitions_the_prompt(engine):
    engine.prefix_cache = type(engine.prefix_cache)(engine.prefix_cache.budget_bytes)
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


def test_exact_prefix_is_validated():
    with pytest.raises(InvalidRequestError, match="exact_prefix"):
        GenerationRequest(((1, 2), (3,)), exact_prefix=2)
