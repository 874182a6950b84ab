"""The fast canonical path (batched, padded, operators fused into the forward's kernel call)
equals the plain reference (one segment at a time, operators from a separate scan)."""

from __future__ import annotations

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.config import Mode
from hypic_core.testing import FAMILIES, tiny_model
from test_operators import assert_close


def maxdiff(a, b):
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def rel(ref, out):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear"])
@pytest.mark.parametrize("seam", [0, 5])
def test_batched_fused_entries_equal_reference(family, seam):
    engine = engines.engine(8, family)
    assert engine.adapter.supports_fused_body
    segs = random_segments((40, 2, 9, 17, 3, 65), seed=seam)  # shorter than the seam and the conv kernel too
    with torch.inference_mode():
        fast = engine.runner.compute_entries(segs, seam, max_batch_tokens=4096)
        ref = engine.runner.compute_entries_reference(segs, seam)
    for f, r in zip(fast, ref):
        assert f.token_ids == r.token_ids and f.seam == r.seam == min(seam, len(r.token_ids))
        assert len(f.operators) == len(r.operators) and len(f.conv_tails) == len(r.conv_tails)
        for a, b in zip(f.keys + f.values, r.keys + r.values):
            assert maxdiff(a, b) <= 1e-5
        for a, b in zip(f.operators, r.operators):
            assert rel(b.transition, a.transition) <= 1e-5 and rel(b.end, a.end) <= 1e-5
        for a, b in zip(f.conv_tails, r.conv_tails):
            assert maxdiff(a, b) <= 1e-5


def test_batches_split_by_token_budget():
    engine = engines.engine(8)
    segs = random_segments((30, 30, 30, 30), seed=1)
    with torch.inference_mode():
        small = engine.runner.compute_entries(segs, 4, max_batch_tokens=60)  # two rows per batch
        big = engine.runner.compute_entries(segs, 4, max_batch_tokens=4096)
    for a, b in zip(small, big):
        assert all(rel(x.end, y.end) <= 1e-5 for x, y in zip(a.operators, b.operators))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seam", [0, 3, 100])
def test_fused_stitch_equals_sequential_stitch(family, seam):
    """Every family: one fused forward over all seam heads and the question equals the plain
    sequential stitch (first-token logits, and the final K/V, conv and recurrent states)."""
    engine = engines.engine(8, family)
    assert engine.adapter.supports_fused_stitch
    segs = random_segments((12, 40, 2, 17, 3, 33, 7), seed=seam)
    context, question = segs[:-1], segs[-1]
    entries, _ = engine.segment_entries(context, seam)
    runner = engine.runner
    with torch.inference_mode():
        for mode in (Mode.HYPIC, Mode.PIC_NAIVE):
            fused_cache, seq_cache = runner.new_cache(), runner.new_cache()
            fused = runner.stitch(fused_cache, context, entries, question, mode is Mode.HYPIC)
            seq = runner.stitch_sequential(seq_cache, context, entries, question, mode is Mode.HYPIC)
            assert_close(f"{family} {mode.value} logits", seq, fused, 1e-5)
            # The fused cache holds the bodies' K/V first, then the run tokens': same columns, another order.
            order = torch.argsort(fused_key_positions(segs, entries))
            fk, fv = runner.attention.kv(fused_cache)
            sk, sv = runner.attention.kv(seq_cache)
            for a, b in zip(fk + fv, sk + sv):
                assert maxdiff(b, a[:, :, order]) <= 1e-5
            for p, ((fc, fs), (sc, ss)) in enumerate(zip(runner.linear.rows(fused_cache), runner.linear.rows(seq_cache))):
                assert maxdiff(sc, fc) <= 1e-5, f"layer {p} conv"
                assert_close(f"{family} {mode.value} state {p}", ss, fs, 1e-5)
            # The caches continue identically: decode one more token on each.
            nxt = [int(seq.argmax())]
            pos = sum(map(len, segs))
            a = runner.forward(nxt, pos, fused_cache, logits=True)
            b = runner.forward(nxt, pos, seq_cache, logits=True)
            assert maxdiff(b, a) <= 1e-5


def fused_key_positions(segs, entries) -> torch.Tensor:
    """Positions of a fused stitch cache's K/V columns: every body, then the seam heads and the question."""
    bodies, runs, offset = [], [], 0
    for seg, entry in zip(segs, entries):
        runs += range(offset, offset + entry.seam)
        if entry.body_length:
            bodies += range(offset + entry.seam, offset + len(seg))
        offset += len(seg)
    return torch.tensor(bodies + runs + list(range(offset, offset + len(segs[-1]))))


def test_fused_stitch_with_eager_attention():
    model = tiny_model("qwen3_5")
    model.set_attn_implementation("eager")
    engine = engines.engine(8, model=model)  # its own model: eager attention is set on it
    segs = random_segments((12, 30, 5, 21, 6), seed=4)
    entries, _ = engine.segment_entries(segs[:-1], 3)
    with torch.inference_mode():
        fused = engine.runner.stitch(engine.runner.new_cache(), segs[:-1], entries, segs[-1])
        seq = engine.runner.stitch_sequential(engine.runner.new_cache(), segs[:-1], entries, segs[-1])
    assert maxdiff(seq, fused) <= 1e-5
