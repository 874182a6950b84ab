"""Invariant 1 for the Mamba2, Kimi delta attention and lightning families: composed span
operators built by each adapter equal that family's plain sequential scan (fp32, relative <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from hypic_core.adapters import adapter_for
from hypic_core.adapters import kimi, lightning, mamba2
from hypic_core.algebra.operators import compose, compose_tree
from hypic_core.testing import tiny_model
from test_operators import assert_close, rel_err

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


@pytest.mark.parametrize("L", [1, 3, 8, 20, 64])
@pytest.mark.parametrize("start", ["zero", "state"])
def test_mamba2_short_span_block_equals_the_chunked_scan(L, start):
    """`ssd_span` (one closed-form block, what a stitch runs for a seam head) gives the layer's chunked
    scan's output and final state, from a zero or a carried state, with D, groups and a dt clamp; its
    final state equals the plain sequential scan's."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    scan = getattr(mamba2_chunk_scan, "__wrapped__", mamba2_chunk_scan)
    A, dt_bias = mamba2_params(h=4, slow=False, seed=2)
    x, dt, B = mamba2_span(L, g=2, seed=5)
    C = torch.randn(1, L, 2, 16, generator=torch.Generator().manual_seed(9))
    D = torch.randn(4, generator=torch.Generator().manual_seed(11))
    s0 = torch.randn(1, 4, 32, 16) if start == "state" else None
    limit = (0.05, 3.0)
    y_ref, s_ref = scan(x, dt, A, B, C, 16, D=D, dt_bias=dt_bias, initial_states=s0, dt_softplus=True,
                        dt_limit=limit, return_final_states=True)
    y, s = mamba2.ssd_span(x, dt, A, B, C, D=D, dt_bias=dt_bias, initial_states=s0, dt_softplus=True, dt_limit=limit)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert_close(f"output L={L}", y_ref, y, 1e-5)
    assert_close(f"state L={L}", s_ref, s, 1e-5)
    assert_close(f"naive L={L}", mamba2.naive_scan(x, dt, A, B, dt_bias, True, limit, initial_state=s0), s, 1e-5)


def kda_span(L, h=4, dk=16, dv=16, seed=0, slow=True):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, L, h, dk, generator=gen)
    v = torch.randn(1, L, h, dv, generator=gen)
    lo, hi = (-0.02, -0.001) if slow else (-2.0, -0.1)
    g = torch.empty(1, L, h, dk).uniform_(lo, hi, generator=gen)  # one decay per key channel
    beta = torch.rand(1, L, h, generator=gen)
    return k, v, g, beta


def test_kda_composition_equals_sequential_scan_32_spans():
    adapter = adapter_for(tiny_model("kimi_linear"))
    spans = [kda_span(L, seed=i) for i, L in enumerate(SPAN_LENGTHS)]
    ops = [adapter.operator(*span, l2norm=True) for span in spans]
    cat = [torch.cat([s[i] for s in spans], dim=1) for i in range(4)]
    s0 = torch.randn(1, 4, 16, 16)
    ref = kimi.naive_scan(*cat, initial_state=s0)[0]
    assert_close("kda 32 spans", ref, compose(ops).apply(s0[0]), 1e-5)
    assert_close("kda tree", ref, compose_tree(ops).apply(s0[0]), 1e-5)
    assert_close("kda E", kimi.naive_scan(*spans[0])[0], ops[0].end, 1e-5)


def test_kda_operator_exact_for_fast_per_channel_decay():
    adapter = adapter_for(tiny_model("kimi_linear"))
    k, v, g, beta = kda_span(90, seed=3, slow=False)  # > one 64-token kernel chunk
    op = adapter.operator(k, v, g, beta, l2norm=True)
    s0 = torch.randn(1, 4, 16, 16)
    assert_close("kda fast decay", kimi.naive_scan(k, v, g, beta, initial_state=s0)[0], op.apply(s0[0]), 1e-5)
    # A per-head decay (GDN's) would give another state: the channel dimension matters.
    per_head = adapter.operator(k, v, g.mean(-1, keepdim=True).expand_as(g), beta, l2norm=True)
    assert rel_err(op.end, per_head.end) > 1e-2


def test_lightning_composition_equals_sequential_scan_32_spans():
    gen = torch.Generator().manual_seed(0)
    slopes = torch.empty(4).uniform_(0.002, 0.3, generator=gen)  # slow and fast heads side by side
    spans = [(torch.randn(L, 4, 16, generator=gen), torch.randn(L, 4, 16, generator=gen)) for L in SPAN_LENGTHS]
    ops = [lightning.LightningAdapter.operator(k, v, slopes) for k, v in spans]
    k, v = (torch.cat([s[i] for s in spans]) for i in range(2))
    s0 = torch.randn(4, 16, 16, generator=gen)
    ref = lightning.naive_scan(k, v, slopes, initial_state=s0)
    assert_close("lightning 32 spans", ref, compose(ops).apply(s0), 1e-5)
    assert_close("lightning tree", ref, compose_tree(ops).apply(s0), 1e-5)
    assert_close("lightning E", lightning.naive_scan(*spans[0], slopes), ops[0].end, 1e-5)


def test_lightning_operator_matches_the_model_block_scan():
    """E from the adapter equals the state MiniMax's own block-wise prefill leaves in its cache."""
    model = tiny_model("minimax")
    adapter = adapter_for(model)
    ids = torch.randint(2, 320, (1, 37), generator=torch.Generator().manual_seed(1))  # 3 blocks of 16
    cache = adapter.new_cache()
    with torch.inference_mode(), adapter.capture() as cap:
        model.base_model(input_ids=ids, position_ids=torch.arange(37)[None], cache=cache, use_cache=True)
    for pos, op in enumerate(adapter.span_operators(cap, 0, 0, 37)):
        _, state = adapter.linear_state_or_zero(cache, pos)
        assert_close(f"lightning layer {pos}", state, op.end, 1e-5)
