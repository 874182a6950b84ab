"""Invariant 1 for the Mamba2, Kimi delta attention and lightning families: composed span
operators built by each adapter equal that family's plain sequential scan (fp32, relative <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from hypic_core.adapters import adapter_for
from hypic_core.adapters import mamba2
from hypic_core.operators import compose, compose_tree
from hypic_core.testing import tiny_model
from test_operators import assert_close

MAMBA2_FAMILIES = ["bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1"]
SPAN_LENGTHS = torch.randint(1, 40, (32,), generator=torch.Generator().manual_seed(7)).tolist()


def mamba2_span(L, h=4, p=32, g=1, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, L, h, p, generator=gen)
    dt = torch.randn(1, L, h, generator=gen)
    B = torch.randn(1, L, g, n, generator=gen)
    return x, dt, B


def mamba2_params(h=4, slow=True, seed=0):
    gen = torch.Generator().manual_seed(100 + seed)
    lo, hi = (0.01, 0.05) if slow else (0.5, 4.0)
    A = -torch.empty(h).uniform_(lo, hi, generator=gen)
    dt_bias = torch.randn(h, generator=gen)
    return A, dt_bias


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_mamba2_composition_equals_sequential_scan_32_spans(family):
    adapter = adapter_for(tiny_model(family))
    A, dt_bias = mamba2_params()
    limit = (0.0, float("inf"))
    spans = [mamba2_span(L, seed=i) for i, L in enumerate(SPAN_LENGTHS)]
    # chunk 16: spans longer than a chunk exercise the kernel's inter-chunk recurrence too
    ops = [adapter.operator(x, dt, A, B, dt_bias, True, limit, 16) for x, dt, B in spans]
    x, dt, B = (torch.cat([s[i] for s in spans], dim=1) for i in range(3))
    s0 = torch.randn(1, 4, 32, 16)
    ref = mamba2.naive_scan(x, dt, A, B, dt_bias, True, limit, initial_state=s0)[0]
    assert_close(f"{family} 32 spans", ref, compose(ops).apply(s0[0]), 1e-5)
    assert_close(f"{family} tree", ref, compose_tree(ops).apply(s0[0]), 1e-5)
    x0, dt0, B0 = spans[0]
    assert_close(f"{family} E", mamba2.naive_scan(x0, dt0, A, B0, dt_bias, True, limit)[0], ops[0].end, 1e-5)


def test_mamba2_operator_exact_for_fast_decay_groups_and_dt_limit():
    adapter = adapter_for(tiny_model("bamba"))
    A, dt_bias = mamba2_params(h=4, slow=False, seed=1)
    x, dt, B = mamba2_span(50, g=2, seed=3)  # two groups of two heads share B
    limit = (0.05, 0.8)  # the clamp must be applied to T exactly as the kernel applies it
    op = adapter.operator(x, dt, A, B, dt_bias, True, limit, 16)
    s0 = torch.randn(1, 4, 32, 16)
    ref = mamba2.naive_scan(x, dt, A, B, dt_bias, True, limit, initial_state=s0)[0]
    assert_close("fast decay span", ref, op.apply(s0[0]), 1e-5)
    assert op.transition.shape == (4,)
    # Without the clamp the transition differs: the test can fail.
    unclamped = adapter.operator(x, dt, A, B, dt_bias, True, (0.0, float("inf")), 16)
    assert not torch.allclose(unclamped.transition, op.transition)
