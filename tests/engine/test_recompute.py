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


def _bench():
    """bench/accuracy_real.py (a script, loaded by path): its `install_recompute` applies the widths to an engine."""
    from helpers import ROOT, load_script

    return load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")


def test_widths_in_the_stitched_prefill_whole_budget_equals_full_and_no_budget_equals_the_default():
    import torch

    import engines
    from hypic_core.config import GenerationRequest, SamplingParams

    bench = _bench()
    gen = torch.Generator().manual_seed(3)
    lengths = (11, 40, 33, 52, 9)  # the last is the question
    segs = tuple(tuple(int(t) for t in torch.randint(5, 200, (n,), generator=gen)) for n in lengths)

    def prefill(engine, mode="hypic"):
        return engine.prefill(GenerationRequest(segs, mode=mode, sampling=SamplingParams(max_tokens=1)))

    plain = engines.engine(8)
    full = prefill(plain, "full").logits
    default = prefill(plain)
    whole = engines.engine(8)
    bench.install_recompute(whole, "1.0")
    out = prefill(whole)
    assert out.stats.seam_tokens == sum(lengths[:-1])
    assert (out.logits - full).abs().max().item() <= 1e-4  # every segment recomputed: the golden test
    none = engines.engine(8)
    bench.install_recompute(none, "0")
    assert torch.equal(prefill(none).logits, default.logits)
    part = engines.engine(8)
    bench.install_recompute(part, "0.2")
    out = prefill(part)
    widths = head_widths(lengths[:-1], [8] * 4, 0.2)
    assert widths != (8, 8, 8, 8) and out.stats.seam_tokens == sum(widths)
    assert (out.logits - default.logits).abs().max().item() > 1e-6  # the wider heads changed the stitch
