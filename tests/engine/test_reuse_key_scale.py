"""Rung 4 of the accuracy ladder: a temperature on reused keys (`EngineConfig.reuse_key_scale`).

The stitched bodies' keys are multiplied by the scale after rotation; seam heads, exact runs and the
question keep theirs. Pinned here: the fused stitch equals the sequential one at any scale; both equal
the stitch of entries whose keys were scaled beforehand (rotation commutes with the scale); 1.0 is the
stitch as it was; a seam covering every segment (no body) still equals `full`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, InvalidRequestError, SamplingParams

FAMILIES = ["qwen3_5", "llama", "bamba", "kimi_linear", "olmo_hybrid"]
LENGTHS = (12, 40, 2, 17, 3, 33, 7)  # system prompt, five chunks (one shorter than the seam), question


def maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_stitch_fused_sequential_and_prescaled_entries_agree(family):
    engine = engines.engine(8, family)
    segs = random_segments(LENGTHS, seed=5)
    context, question = segs[:-1], segs[-1]
    entries, _ = engine.segment_entries(context, 3)
    prescaled = [dataclasses.replace(e, keys=tuple(k * 1.5 for k in e.keys)) for e in entries]
    runner = engine.runner
    with torch.inference_mode():
        plain = runner.stitch(runner.new_cache(), context, entries, question)
        fused_cache, seq_cache = runner.new_cache(), runner.new_cache()
        fused = runner.stitch(fused_cache, context, entries, question, key_scale=1.5)
        seq = runner.stitch_sequential(seq_cache, context, entries, question, key_scale=1.5)
        reference = runner.stitch_sequential(runner.new_cache(), context, prescaled, question)
        same = runner.stitch(runner.new_cache(), context, entries, question, key_scale=1.0)
    assert maxdiff(seq, fused) <= 1e-5 and maxdiff(reference, seq) <= 1e-5
    assert maxdiff(plain, same) == 0.0
    assert maxdiff(plain, fused) > 1e-3, "the scale must change what the question reads"
    # The fused cache holds the bodies' keys first: exactly the rotated entry keys x 1.5.
    body = sum(len(s) - e.seam for s, e in zip(context, entries) if e.body_length)
    keys, _ = runner.attention.kv(fused_cache)
    offsets = [sum(map(len, context[:i])) for i in range(len(context))]
    for j, k in enumerate(keys):
        expected = torch.cat([engine.adapter.rotate_keys(e.keys[j], o) for e, o in zip(entries, offsets) if e.body_length],
                             dim=1)
        assert maxdiff(k[0, :, :body], 1.5 * expected) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_engine_applies_the_scale_to_stitched_requests_only(family):
    base = engines.engine(8, family)
    scaled = engines.engine(like=base, reuse_key_scale=0.5)
    lengths = (14, 40, 31, 23, 9, 6)
    segs = random_segments(lengths, seed=7)

    def logits(engine, mode, seam=None):
        request = GenerationRequest(tuple(segs), mode=mode, seam=seam, sampling=SamplingParams(max_tokens=1))
        return engine.prefill(request).logits

    assert maxdiff(logits(base, "hypic"), logits(scaled, "hypic")) > 1e-4  # tiny random models: small logits
    for mode in ("full", "prefix"):
        assert maxdiff(logits(base, mode), logits(scaled, mode)) <= 1e-5, mode
    # No body, nothing scaled: a seam covering every segment still reproduces full.
    assert maxdiff(logits(scaled, "full"), logits(scaled, "hypic", seam=max(lengths))) <= 1e-4


@pytest.mark.parametrize("bad", [0.0, -1.0, 0.1, 5.0, math.nan, math.inf])
def test_out_of_range_scale_is_refused_by_name(bad):
    with pytest.raises(InvalidRequestError, match="reuse_key_scale"):
        EngineConfig(reuse_key_scale=bad)


def test_gateway_setting_reaches_the_engine(tmp_path, monkeypatch):
    from pathlib import Path

    from pydantic import ValidationError

    from app.service.runtime import load_engine
    from app.service.settings import Settings

    tiny = Path(__file__).resolve().parents[2] / "models" / "hypic-tiny"
    monkeypatch.setenv("HYPIC_REUSE_KEY_SCALE", "0.9")
    assert load_engine(Settings(model=str(tiny), index_dir=tmp_path / "index", cache_dir=None)).config.reuse_key_scale == 0.9
    monkeypatch.setenv("HYPIC_REUSE_KEY_SCALE", "0")
    with pytest.raises(ValidationError, match="reuse_key_scale"):
        Settings()


def test_benchmark_prototype_unscales_exactly_the_bodies():
    """bench/accuracy_real.py's `~Sq` prototype sets the bodies' keys back to 1x after the prefill: its
    column range (after the exact run, before the seam heads and the question) must be the bodies'."""
    from helpers import ROOT, load_script

    bench = load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")
    base = engines.engine(8, "llama")  # attention in every layer: the later layers' keys read the earlier ones'
    scaled = engines.engine(like=base, reuse_key_scale=0.5)
    segs = random_segments((14, 40, 3, 23, 31, 6), seed=9)  # system prompt (exact), four documents, question
    request = GenerationRequest(tuple(segs), mode="hypic", exact_prefix=1, sampling=SamplingParams(max_tokens=1))
    for warmth in ("cold", "warm"):
        plain, pre = base.prefill(request), scaled.prefill(request)
        bench.unscale_bodies(scaled, pre, request)  # asserts its columns hold the bodies' token count
        a, b = 14, 14 + 40 + 23 + 31 - 3 * 8  # after the system prompt; the 3-token document is all seam head
        pairs = list(zip(base.runner.attention.kv(plain.cache)[0], scaled.runner.attention.kv(pre.cache)[0]))
        assert all(maxdiff(k_plain[:, :, :b], k_back[:, :, :b]) <= 1e-6 for k_plain, k_back in pairs), warmth
        # seam heads and question were computed reading 0.5x keys (from the second attention layer on)
        assert max(maxdiff(k_plain[:, :, b:], k_back[:, :, b:]) for k_plain, k_back in pairs) > 1e-6
