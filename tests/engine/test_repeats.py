"""Repeats under `EngineConfig.repeats`: with "exact" a run seen before in this order is computed
exactly at its second sighting (a snapshot kept, equal to full from then on); with "cheaper" a repeat
whose entries are stored composes, as its first sighting did, because the cost model puts a few seam
heads below a forward over the run."""

from __future__ import annotations

from engines import engine, random_segments, request

LENGTHS = (14, 20, 16, 18, 6)


def test_a_warm_repeat_composes_under_cheaper():
    eng = engine(seam=4, exact_repeats=True, repeats="cheaper")
    segs = random_segments(LENGTHS, seed=31)
    first, second, third = (list(eng.generate(request(segs)))[0] for _ in range(3))
    assert first.stats.segment_misses == 4 and first.stats.exact_tokens == 0
    for out in (second, third):
        assert out.finish_reason != "error", out.error
        assert out.stats.exact_tokens == 0 and out.stats.segment_hits == 4 and out.stats.segment_misses == 0
        assert out.stats.composed_tokens == sum(n - 4 for n in LENGTHS[:-1])
        assert (out.logits - first.logits).abs().max().item() <= 1e-5  # the same entries, the same stitch


def test_the_exact_rule_computes_the_same_repeat():
    eng = engine(seam=4, exact_repeats=True)
    segs = random_segments(LENGTHS, seed=31)
    full = eng.prefill(request(segs, "full")).logits
    first, second, third = (list(eng.generate(request(segs)))[0] for _ in range(3))
    assert second.stats.composed_tokens == second.stats.seam_tokens == 0  # computed in context
    assert third.stats.exact_tokens == sum(LENGTHS[:-1])  # and restored from the snapshot it kept
    assert (second.logits - full).abs().max().item() <= 1e-4
    assert (first.logits - full).abs().max().item() > 1e-4  # composed differs: the rule changed something


def test_the_gateway_setting_reaches_the_engine_and_a_bad_value_names_it(monkeypatch, tmp_path):
    from pathlib import Path

    import pytest
    from pydantic import ValidationError

    from app.service.runtime import load_engine
    from app.service.settings import Settings

    tiny = Path(__file__).resolve().parents[2] / "models" / "hypic-tiny"
    monkeypatch.setenv("HYPIC_REPEATS", "cheaper")
    settings = Settings(model=str(tiny), index_dir=tmp_path / "index", cache_dir=tmp_path / "cache")
    assert load_engine(settings).config.repeats == "cheaper"
    monkeypatch.setenv("HYPIC_REPEATS", "sometimes")
    with pytest.raises(ValidationError, match="repeats"):
        Settings()
