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
    with pytest.raises(InvalidRequestError, match="reuse_key_scope"):
        EngineConfig(reuse_key_scope="answer")


def test_gateway_setting_reaches_the_engine(tmp_path, monkeypatch):
    from pathlib import Path

    from pydantic import ValidationError

    from app.service.runtime import load_engine
    from app.service.settings import Settings

    tiny = Path(__file__).resolve().parents[2] / "models" / "hypic-tiny"
    monkeypatch.setenv("HYPIC_REUSE_KEY_SCALE", "0.9")
    monkeypatch.setenv("HYPIC_REUSE_KEY_SCOPE", "all")
    config = load_engine(Settings(model=str(tiny), index_dir=tmp_path / "index", cache_dir=None)).config
    assert (config.reuse_key_scale, config.reuse_key_scope) == (0.9, "all")
    monkeypatch.setenv("HYPIC_REUSE_KEY_SCALE", "0")
    with pytest.raises(ValidationError, match="reuse_key_scale"):
        Settings()


def test_prompt_scope_sets_the_bodies_back_before_the_answer():
    """reuse_key_scope "prompt": the stitch and the rest of the prompt read the scaled keys; once the prefill
    ends the bodies' keys are the unscaled engine's again (so the answer reads them as computed), and the
    seam heads and question keep what they computed. Scope "all" keeps them scaled."""
    base = engines.engine(8, "llama")  # attention in every layer: the later layers' keys read the earlier ones'
    prompt = engines.engine(like=base, reuse_key_scale=0.5)
    always = engines.engine(like=base, reuse_key_scale=0.5, reuse_key_scope="all")
    segs = random_segments((14, 40, 3, 23, 31, 6), seed=9)  # system prompt (exact), four documents, question
    request = GenerationRequest(tuple(segs), mode="hypic", exact_prefix=1, sampling=SamplingParams(max_tokens=1))
    b = 14 + 40 + 23 + 31 - 3 * 8  # after the system prompt, the bodies (the 3-token document is all seam head)
    for warmth in ("cold", "warm"):
        plain, pre, kept = base.prefill(request), prompt.prefill(request), always.prefill(request)
        assert maxdiff(pre.logits, kept.logits) == 0.0 and maxdiff(plain.logits, pre.logits) > 1e-4, warmth
        pairs = list(zip(base.runner.attention.kv(plain.cache)[0], prompt.runner.attention.kv(pre.cache)[0],
                         always.runner.attention.kv(kept.cache)[0]))
        assert all(maxdiff(k0[:, :, :b], k1[:, :, :b]) <= 1e-6 for k0, k1, _ in pairs), warmth
        assert all(maxdiff(k1[:, :, b:], k2[:, :, b:]) == 0.0 for _, k1, k2 in pairs)  # seam heads, question: as read
        assert all(maxdiff(k0[:, :, 14:b] * 0.5, k2[:, :, 14:b]) <= 1e-6 for k0, _, k2 in pairs)
        assert max(maxdiff(k0[:, :, b:], k1[:, :, b:]) for k0, k1, _ in pairs) > 1e-6


def test_body_columns_on_the_sequential_path(monkeypatch):
    """Where the adapter has no fused stitch, each body sits after its own seam head; setting those
    columns back to 1x gives the unscaled sequential stitch's keys."""
    engine = engines.engine(8, "llama")
    segs = random_segments((12, 40, 2, 17, 3, 33, 7), seed=5)
    context, question = segs[:-1], segs[-1]
    entries, _ = engine.segment_entries(context, 3)
    runner = engine.runner
    monkeypatch.setattr(type(engine.adapter), "supports_fused_stitch", property(lambda self: False))
    spans = runner.body_columns(context, entries)
    assert spans == [(3, 12), (15, 52), (57, 71), (77, 107)]
    with torch.inference_mode():
        plain, scaled = runner.new_cache(), runner.new_cache()
        runner.stitch(plain, context, entries, question)
        runner.stitch(scaled, context, entries, question, key_scale=0.5)
    runner.attention.scale_keys(scaled, spans, 2.0)
    columns = [c for a, b in spans for c in range(a, b)]
    for k0, k1 in zip(runner.attention.kv(plain)[0], runner.attention.kv(scaled)[0]):
        assert maxdiff(k0[:, :, columns], k1[:, :, columns]) <= 1e-6


def test_prompt_scope_with_a_chunked_prefill_answers_as_at_once():
    """The question split over steps (a small step budget) reads the scaled bodies throughout, and the
    keys come back to 1x only when its last run ends: the same logits, step for step, as at once."""
    whole = engines.engine(8, "llama", reuse_key_scale=0.5)
    chunked = engines.engine(like=whole, max_step_tokens=16)
    segs = random_segments((14, 40, 23, 31, 37), seed=11)  # a 37-token question: three runs after the stitch
    outs = []
    for engine in (whole, chunked):
        seq = engine.add_request(engines.request(segs, max_tokens=4), collect=True)
        while not seq.finished:
            engine.step()
        outs.append(seq.outbox)
        steps = seq.stats.prefill_steps
    assert steps >= 3, "the chunked prefill was spread over steps"
    assert [o.token_id for o in outs[0]] == [o.token_id for o in outs[1]]
    assert outs[0][0].logits is not None and maxdiff(outs[0][0].logits, outs[1][0].logits) <= 1e-4
