"""hypic_core/engine/recompute.py: the rung-3 recompute budget spent as seam width, table by table."""

from __future__ import annotations

import math
import random

import pytest

from hypic_core.engine.recompute import head_widths


@pytest.mark.parametrize("lengths, base, ratio, priority, quantum, expected", [
    ([80, 80, 80], [8, 8, 8], 0.0, None, 16, (8, 8, 8)),  # no budget: the usual heads
    # 10% of 216 reused = 22 tokens: the last segment to 16 (8 used), the one before to 16 (8), 6 left unused
    ([80, 80, 80], [8, 8, 8], 0.1, None, 16, (8, 16, 16)),
    ([80, 80, 80], [8, 8, 8], 0.1, None, 1, (8, 8, 30)),  # no grid: all 22 on the nearest segment
    # 50% of 66 = 33: the last segment whole (32), 1 left is less than a step
    ([20, 30, 40], [8, 8, 8], 0.5, None, 16, (8, 8, 40)),
    ([20, 30, 40], [8, 8, 8], 0.5, [0, 1, 2], 16, (20, 16, 16)),  # first segment first: 12 whole, 8 + 8, 13 left -> 8
    ([20, 30, 40], [8, 8, 8], 1.0, None, 16, (20, 30, 40)),  # everything recomputed: the whole prompt in context
    ([5, 300], [8, 8], 0.0, None, 16, (5, 8)),  # a head is at most its segment
    ([100, 100], [45, 8], 0.1, None, 16, (48, 16)),  # 15 tokens: 8 to the last, 3 of the 7 left to 48
])
def test_widths_table(lengths, base, ratio, priority, quantum, expected):
    assert head_widths(lengths, base, ratio, priority, quantum) == expected


def test_widths_respect_the_budget_the_grid_and_the_bounds():
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(1, 10)
        lengths = [rng.randint(1, 400) for _ in range(k)]
        base = [rng.choice([0, 2, 8, 32]) for _ in range(k)]
        ratio = rng.choice([0.0, 0.05, 0.1, 0.2, 0.5, 1.0])
        quantum = rng.choice([1, 8, 16])
        order = list(range(k))
        rng.shuffle(order)
        widths = head_widths(lengths, base, ratio, order, quantum)
        floor = [min(b, n) for b, n in zip(base, lengths)]
        budget = math.ceil(ratio * sum(n - f for n, f in zip(lengths, floor)) - 1e-9)
        assert sum(w - f for w, f in zip(widths, floor)) <= budget
        for w, f, n in zip(widths, floor, lengths):
            assert f <= w <= n
            assert w in (f, n) or w % quantum == 0
        if ratio == 1.0:
            assert list(widths) == lengths
        # the first segment in priority order takes what it can of the whole budget
        i = order[0]
        first = lengths[i] if lengths[i] - floor[i] <= budget else max(floor[i], (floor[i] + budget) // quantum * quantum)
        assert widths[i] == first


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=[10], base=[8, 8], ratio=0.1), "base"),
    (dict(lengths=[10], base=[8], ratio=1.5), "ratio"),
    (dict(lengths=[10], base=[8], ratio=float("nan")), "ratio"),
    (dict(lengths=[10], base=[8], ratio=0.1, quantum=0), "quantum"),
    (dict(lengths=[10, 10], base=[8, 8], ratio=0.1, priority=[0, 0]), "priority"),
])
def test_bad_input_names_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        head_widths(**kwargs)


def _segments(lengths, seed=3):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(int(t) for t in torch.randint(5, 200, (n,), generator=gen)) for n in lengths)


LENGTHS = (11, 40, 33, 52, 9)  # the last is the question


def _prefill(engine, segs, mode="hypic", **kw):
    from hypic_core.config import GenerationRequest, SamplingParams

    return engine.prefill(GenerationRequest(segs, mode=mode, sampling=SamplingParams(max_tokens=1), **kw))


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_whole_budget_equals_full_and_no_budget_equals_the_default(family):
    """EngineConfig.recompute_ratio in the stitched prefill: 1.0 computes every segment in context (the golden
    test: `full`'s logits), 0.0 is the default bit for bit, and a budget in between widens exactly the heads
    `head_widths` gives."""
    import torch

    import engines

    segs = _segments(LENGTHS)
    plain = engines.engine(8, family)
    full = _prefill(plain, segs, "full").logits
    default = _prefill(plain, segs)
    out = _prefill(engines.engine(8, family, recompute_ratio=1.0), segs)
    assert out.stats.seam_tokens == sum(LENGTHS[:-1])
    assert (out.logits - full).abs().max().item() <= 1e-4
    assert torch.equal(_prefill(engines.engine(8, family, recompute_ratio=0.0), segs).logits, default.logits)
    out = _prefill(engines.engine(8, family, recompute_ratio=0.2), segs)
    widths = head_widths(LENGTHS[:-1], [8] * 4, 0.2)
    assert widths != (8, 8, 8, 8) and out.stats.seam_tokens == sum(widths)
    assert (out.logits - default.logits).abs().max().item() > 1e-6  # the wider heads changed the stitch


def test_a_request_names_its_own_budget_and_widened_entries_are_kept():
    """`GenerationRequest.recompute` overrides the engine's ratio either way; the widened segments' entries
    are stored at their width, so the same request again computes no entry; pic-naive takes the budget too,
    `full` and `prefix` ignore it."""
    import torch

    import engines

    segs = _segments(LENGTHS, seed=5)
    engine = engines.engine(8, recompute_ratio=0.2)
    plain = engines.engine(8)
    assert torch.equal(_prefill(engine, segs, recompute=0.0).logits, _prefill(plain, segs).logits)
    first = _prefill(plain, segs, recompute=0.2)
    assert first.stats.seam_tokens == sum(head_widths(LENGTHS[:-1], [8] * 4, 0.2))
    again = _prefill(plain, segs, recompute=0.2)
    assert again.stats.segment_misses == 0 and torch.equal(again.logits, first.logits)
    assert _prefill(plain, segs, "pic-naive", recompute=1.0).stats.seam_tokens == sum(LENGTHS[:-1])
    full = _prefill(plain, segs, "full")
    assert torch.equal(_prefill(plain, segs, "full", recompute=1.0).logits, full.logits)
    exact = _prefill(plain, segs, recompute=0.5, exact_prefix=1)  # the budget is spread past the exact prefix
    assert exact.stats.seam_tokens == sum(head_widths(LENGTHS[1:-1], [8] * 3, 0.5))


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_a_bad_budget_names_its_field(value):
    from hypic_core.config import EngineConfig, GenerationRequest
    from hypic_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="recompute"):
        GenerationRequest(((1, 2), (3,)), recompute=value)
    if not isinstance(value, (bool, str)):
        with pytest.raises(InvalidRequestError, match="recompute_ratio"):
            EngineConfig(recompute_ratio=value)


def test_gateway_setting_reaches_the_engine_and_the_guard(tmp_path, monkeypatch):
    from pathlib import Path

    from pydantic import ValidationError

    from app.service.guard import GuardConfig
    from app.service.runtime import load_engine
    from app.service.settings import Settings

    tiny = Path(__file__).resolve().parents[2] / "models" / "hypic-tiny"
    monkeypatch.setenv("HYPIC_RECOMPUTE_RATIO", "0.1")
    monkeypatch.setenv("HYPIC_GUARD_MAX_RECOMPUTE", "0.4")
    settings = Settings(model=str(tiny), index_dir=tmp_path / "index", cache_dir=None)
    assert load_engine(settings).config.recompute_ratio == 0.1
    assert GuardConfig.from_settings(settings).max_recompute == 0.4
    monkeypatch.setenv("HYPIC_RECOMPUTE_RATIO", "2")
    with pytest.raises(ValidationError, match="recompute_ratio"):
        Settings()
