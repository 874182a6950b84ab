"""Golden end-to-end invariants of stitched prefill, for every supported family.

- seam >= segment length reproduces full prefill (first-token logits, greedy continuation);
- one segment, and an exact cached prefix, equal full prefill;
- cold and warm caches give identical tokens;
- pic-naive and hypic differ from full, and hypic's first-token KL from full is below pic-naive's.
"""

from __future__ import annotations

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.config import GenerationRequest, SamplingParams

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "olmo_hybrid_nope", "qwen3", "llama",
            "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1", "kimi_linear", "minimax"]
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "olmo_hybrid_nope", "bamba", "granitemoehybrid", "nemotron_h",
           "zamba2", "falcon_h1", "kimi_linear", "minimax"]
LENGTHS = (14, 40, 31, 23, 9, 6)  # system prompt, four chunks, question


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request):
    return engines.engine(seam=8, family=request.param)


def req(segments, mode, seam=None, max_tokens=6):
    return GenerationRequest(tuple(segments), mode=mode, seam=seam, sampling=SamplingParams(max_tokens=max_tokens))


def logits(engine, segments, mode, seam=None):
    return engine.prefill(req(segments, mode, seam)).logits


def kl(p_logits, q_logits):
    p = torch.log_softmax(p_logits, -1)
    return torch.sum(p.exp() * (p - torch.log_softmax(q_logits, -1))).item()


def test_seam_covering_segments_equals_full(engine):
    segs = random_segments(LENGTHS, seed=1)
    full = logits(engine, segs, "full")
    for mode in ("hypic", "pic-naive"):
        out = logits(engine, segs, mode, seam=max(LENGTHS))
        assert (out - full).abs().max().item() <= 1e-4, mode
        assert engine.generated_tokens(req(segs, mode, seam=max(LENGTHS))) == engine.generated_tokens(req(segs, "full"))


def test_one_segment_equals_full(engine):
    segs = random_segments((37, 7), seed=2)
    full = logits(engine, segs, "full")
    for seam in (0, 3, 8):
        assert (logits(engine, segs, "hypic", seam=seam) - full).abs().max().item() <= 1e-4
    assert engine.generated_tokens(req(segs, "hypic")) == engine.generated_tokens(req(segs, "full"))


def test_exact_prefix_reuse_equals_full(engine):
    segs = random_segments(LENGTHS, seed=3)
    full = logits(engine, segs, "full")
    cold = engine.prefill(req(segs, "prefix"))
    other_question = segs[:-1] + random_segments((5,), seed=99)
    warm = engine.prefill(req(other_question, "prefix"))
    assert warm.stats.segment_hits == len(segs) - 1 and warm.stats.cached_tokens == sum(LENGTHS[:-1])
    assert (cold.logits - full).abs().max().item() <= 1e-4
    assert (warm.logits - logits(engine, other_question, "full")).abs().max().item() <= 1e-4
    # A different first chunk shares only the system prompt.
    shuffled = (segs[0], segs[2], segs[1], *segs[3:])
    partial = engine.prefill(req(shuffled, "prefix"))
    assert partial.stats.segment_hits == 1
    assert (partial.logits - logits(engine, shuffled, "full")).abs().max().item() <= 1e-4


def test_cold_and_warm_cache_give_identical_tokens(engine):
    segs = random_segments(LENGTHS, seed=4)
    fresh = engines.engine(like=engine)
    cold_req = req(segs, "hypic", max_tokens=8)
    cold_prefill = fresh.prefill(cold_req)
    assert cold_prefill.stats.segment_misses == len(segs) - 1
    cold = fresh.generated_tokens(cold_req)
    warm_prefill = fresh.prefill(cold_req)
    assert warm_prefill.stats.segment_hits == len(segs) - 1 and warm_prefill.stats.segment_misses == 0
    assert torch.equal(cold_prefill.logits, warm_prefill.logits)
    assert fresh.generated_tokens(cold_req) == cold
    # Warm entries filled by a request with another order serve this one identically.
    other = engines.engine(like=engine)
    other.prefill(req((segs[0], *reversed(segs[1:-1]), segs[-1]), "hypic"))
    assert torch.equal(other.prefill(cold_req).logits, cold_prefill.logits)


def test_approximate_modes_really_differ_from_full(engine):
    segs = random_segments(LENGTHS, seed=5)
    full = logits(engine, segs, "full")
    for mode in ("hypic", "pic-naive"):
        assert (logits(engine, segs, mode, seam=4) - full).abs().max().item() > 1e-3, mode


@pytest.mark.parametrize("family", HYBRIDS)
def test_hypic_closer_to_full_than_pic_naive(family):
    engine = engines.engine(seam=4, family=family)
    kls = {"hypic": [], "pic-naive": []}
    for seed in range(4):
        segs = random_segments((10, 48, 48, 48, 48, 8), seed=10 + seed)
        full = logits(engine, segs, "full")
        for mode in kls:
            kls[mode].append(kl(full, logits(engine, segs, mode)))
    mean = {m: sum(v) / len(v) for m, v in kls.items()}
    print(f"{family}: first-token KL from full, seam 4: hypic {mean['hypic']:.2e}, pic-naive {mean['pic-naive']:.2e}")
    assert mean["hypic"] < mean["pic-naive"]
    assert mean["hypic"] > 0
