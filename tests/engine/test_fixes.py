"""Two faults found while restructuring the engine, pinned:

- a segment computed piece by piece whose last piece would be one token (a step budget that
  leaves exactly one token of it) failed the request ("list index out of range": a one-token
  forward records no conv inputs); the piece before it now takes that token too;
- a request that stores nothing (`cache_store` false) under exact repeats restored a snapshot
  longer than its exact run and stitched the restored segments again on top of it.
"""

from __future__ import annotations

import pytest
import torch

from engines import engine, random_segments, request

FAMILIES = ["qwen3_5", "bamba", "kimi_linear", "zamba2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_piece_leaves_one_token(family):
    eng = engine(seam=4, family=family)
    seg = random_segments((12,), seed=3)[0]
    with torch.inference_mode():
        whole = eng.runner.compute_entries([seg], 4, 0)[0]
        part = eng.runner.start_entry(seg, 4)
        pieced = eng.runner.advance_entry(part, 11)
    assert pieced is not None and part.done == 12
    for a, b in zip((*pieced.keys, *pieced.conv_tails), (*whole.keys, *whole.conv_tails)):
        assert (a.float() - b.float()).abs().max().item() <= 1e-4


def test_a_step_budget_that_leaves_one_token_of_a_segment():
    eng = engine(seam=4, max_step_tokens=15)
    segs = random_segments((10, 12, 9, 7), seed=3)  # step 2 leaves 1 token of the 9-token segment
    full = engine(seam=4).prefill(request(segs)).logits
    outs = list(eng.generate(request(segs)))
    assert outs[0].finish_reason != "error", outs[0].error
    assert outs[0].stats.segment_misses == 3
    assert (outs[0].logits - full).abs().max().item() <= 1e-4


def test_a_request_that_stores_nothing_stitches_after_the_restored_run():
    eng = engine(seam=4, exact_repeats=True, exact_budget_bytes=1 << 26)
    segs = random_segments((14, 20, 16, 6), seed=21)
    for _ in range(2):  # the second sighting computes the run exactly and keeps it
        list(eng.generate(request(segs)))
    assert list(eng.generate(request(segs)))[0].stats.exact_tokens == 50
    full = eng.prefill(request(segs, "full")).logits
    out = list(eng.generate(request(segs, cache_store=False)))[0]
    assert out.stats.exact_tokens == 50
    assert out.stats.exact_tokens + out.stats.composed_tokens + out.stats.seam_tokens + out.stats.fresh_tokens == 56
    assert (out.logits - full).abs().max().item() <= 1e-4
