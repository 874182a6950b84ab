"""Canonical entries computed after a shared entry prefix (`EngineConfig.entry_prefix`), and seams
that scale with the segment (`EngineConfig.seam_fraction`), on every family.

- an entry computed after prefix P and stitched right after P is exact at ANY seam: the segment's
  K/V (keys rotated back to local positions, then forward again) and its body operators (T, E from a
  zero state, composed onto the prefix's state) are what full prefill computes there;
- seam >= segment length still reproduces full prefill, and one segment (computed exactly) too;
- the fast paths (batched, fused, piece by piece) equal the plain reference under a prefix;
- the prefix is part of the key: an entry computed under one prefix is never served under another;
- a seam fraction widens each head to its share of the segment.
"""

from __future__ import annotations

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.algebra.keys import SegmentKey
from hypic_core.cache.store import MemorySegmentStore
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.testing import FAMILIES

PREFIX = random_segments((6,), seed=77)[0]
LENGTHS = (14, 40, 31, 23, 9, 6)  # system prompt, four chunks, question


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def req(segments, mode="hypic", seam=None, max_tokens=6):
    return GenerationRequest(tuple(segments), mode=mode, seam=seam, sampling=SamplingParams(max_tokens=max_tokens))


def maxdiff(a, b):
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def test_entry_after_its_prefix_is_exact_at_any_seam(family):
    """[P, chunk, question] with entries computed after P: the chunk sits where its entry was
    computed, so at seam 0 its K/V and composed linear states are full prefill's."""
    engine = engines.engine(0, family, entry_prefix=PREFIX)
    chunk, question = random_segments((33, 5), seed=3)
    segs = (PREFIX, chunk, question)
    full = engine.prefill(req(segs, "full")).logits
    for seam in (0, 3):
        engine.prefill(req(segs, seam=seam))  # cold
        out = engine.prefill(req(segs, seam=seam))
        assert out.stats.composed_tokens == len(chunk) - seam  # warm: the chunk's body came from its entry
        assert maxdiff(full, out.logits) <= 1e-4, seam
    assert engine.generated_tokens(req(segs, seam=0)) == engine.generated_tokens(req(segs, "full"))


def test_seam_covering_segments_equals_full_with_prefix(family):
    engine = engines.engine(8, family, entry_prefix=PREFIX)
    segs = random_segments(LENGTHS, seed=1)
    full = engine.prefill(req(segs, "full")).logits
    for mode in ("hypic", "pic-naive"):
        out = engine.prefill(req(segs, mode, seam=max(LENGTHS)))
        assert maxdiff(full, out.logits) <= 1e-4, mode
        assert engine.generated_tokens(req(segs, mode, seam=max(LENGTHS))) == engine.generated_tokens(req(segs, "full"))
    # A seam fraction of 1 covers every segment too.
    whole = engines.engine(0, family, seam_fraction=1.0, entry_prefix=PREFIX)
    assert maxdiff(full, whole.prefill(req(segs)).logits) <= 1e-4


def test_one_segment_equals_full_with_prefix(family):
    engine = engines.engine(8, family, entry_prefix=PREFIX)
    segs = random_segments((37, 7), seed=2)
    full = engine.prefill(req(segs, "full")).logits
    for seam in (0, 3, 8):
        assert maxdiff(full, engine.prefill(req(segs, seam=seam)).logits) <= 1e-4


def test_prefix_changes_entries_and_cold_equals_warm(family):
    segs = random_segments(LENGTHS, seed=4)
    plain = engines.engine(4, family)
    prefixed = engines.engine(4, family, entry_prefix=PREFIX)
    cold = prefixed.prefill(req(segs, max_tokens=8))
    assert cold.stats.segment_misses == len(segs) - 1
    warm = prefixed.prefill(req(segs, max_tokens=8))
    assert warm.stats.segment_hits == len(segs) - 1 and warm.stats.segment_misses == 0
    assert warm.stats.exact_tokens == len(segs[0])  # the first context segment is exact (a snapshot now)
    assert torch.equal(cold.logits, warm.logits)
    assert (plain.prefill(req(segs)).logits - cold.logits).abs().max().item() > 1e-5


def test_prefix_is_part_of_the_key():
    store = MemorySegmentStore(1 << 30)
    a = engines.engine(4, store=store, entry_prefix=PREFIX)
    b = engines.engine(4, store=store, entry_prefix=PREFIX[:-1])
    none = engines.engine(4, store=store)
    segs = random_segments(LENGTHS, seed=5)
    a.prefill(req(segs))
    assert a.prefill(req(segs)).stats.segment_misses == 0
    assert b.prefill(req(segs)).stats.segment_hits == 0  # another prefix: never served A's entries
    assert none.prefill(req(segs)).stats.segment_hits == 0
    seg = segs[1]
    keys = {SegmentKey.of("m", 4, seg, prefix=p).to_str() for p in ((), PREFIX, PREFIX[:-1])}
    assert len(keys) == 3
    assert SegmentKey.of("m", 4, seg).to_str() == SegmentKey.of("m", 4, seg, prefix=()).to_str()
    assert "/p" not in SegmentKey.of("m", 4, seg).to_str()  # no prefix: the key strings of before


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear", "granitemoehybrid", "minimax", "llama"])
def test_fast_paths_equal_reference_with_prefix(family):
    engine = engines.engine(8, family, entry_prefix=PREFIX)
    runner = engine.runner
    segs = random_segments((40, 2, 9, 17, 3, 65), seed=6)  # shorter than the seam and the conv kernel too
    seam = 5
    with torch.inference_mode():
        fast = runner.compute_entries(segs, seam, max_batch_tokens=4096)
        ref = runner.compute_entries_reference(segs, seam)
        pieces = []
        for s in segs:
            part = runner.start_entry(s, seam)
            entry = None
            while entry is None:
                entry = runner.advance_entry(part, 7)
            pieces.append(entry)
    for r, f, p in zip(ref, fast, pieces):
        for other in (f, p):
            assert other.seam == r.seam and len(other.operators) == len(r.operators)
            for a, b in zip(other.keys + other.values, r.keys + r.values):
                assert maxdiff(a, b) <= 1e-4
            for a, b in zip(other.operators, r.operators):
                assert maxdiff(a.transition, b.transition) <= 1e-4 and maxdiff(a.end, b.end) <= 1e-4
            for a, b in zip(other.conv_tails, r.conv_tails):
                assert maxdiff(a, b) <= 1e-5
        for t in r.conv_tails:
            assert t.shape[-1] <= len(r.token_ids)  # a short segment's tail holds its own inputs only


def test_seam_fraction_widens_each_head():
    engine = engines.engine(4, seam_fraction=0.25)
    segs = random_segments((10, 40, 8, 23, 5), seed=7)
    out = engine.prefill(req(segs))
    assert out.stats.seam_tokens == sum(min(len(s), max(4, -(-len(s) // 4))) for s in segs[:-1])
    assert engine.config.head_width(4, 40) == 10 and engine.config.head_width(4, 8) == 4
    # Entries of one head width are the same whichever rule gave it: a fixed seam of 10 shares the 40-token one.
    fixed = engines.engine(10, store=engine.store)
    shared = fixed.prefill(req((segs[0], segs[1], segs[-1]))).stats  # segs[0] had head 4 there: a miss
    assert shared.segment_hits == 1 and shared.composed_tokens == 40 - 10
    with pytest.raises(Exception):
        EngineConfig(seam_fraction=1.5)
