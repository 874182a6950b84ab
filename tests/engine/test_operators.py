"""Invariant 1: composed segment operators equal the sequential scan (fp32, relative <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from hypic_core.adapters import adapter_for
from hypic_core.adapters.gated_deltanet import naive_scan
from hypic_core.algebra.operators import LinearOperator, compose, compose_tree
from hypic_core.testing import tiny_model

GDN_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    err, diff = rel_err(ref, out), (out - ref).abs().max().item()
    print(f"{name}: max abs {diff:.3e}, relative {err:.3e}")
    assert err <= ratio, f"{name}: relative error {err:.3e} > {ratio:.1e} (max abs {diff:.3e})"


def random_span(L, hk=2, hv=4, dk=16, dv=16, seed=0, slow=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, L, hk, dk, generator=g)
    v = torch.randn(1, L, hv, dv, generator=g)
    lo, hi = (-0.02, -0.001) if slow else (-2.0, -0.1)
    gate = torch.empty(1, L, hv).uniform_(lo, hi, generator=g)
    beta = torch.rand(1, L, hv, generator=g)
    return k, v, gate, beta


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_composition_equals_sequential_scan_32_spans(family):
    adapter = adapter_for(tiny_model(family))
    spans = [random_span(L, seed=i) for i, L in enumerate(torch.randint(1, 40, (32,), generator=torch.Generator().manual_seed(7)).tolist())]
    ops = [adapter.operator(*span, l2norm=True) for span in spans]
    cat = [torch.cat([s[i] for s in spans], dim=1) for i in range(4)]
    s0 = torch.randn(1, 4, 16, 16)
    ref = naive_scan(*cat, initial_state=s0)[0]
    assert_close(f"{family} 32 spans", ref, compose(ops).apply(s0[0]), 1e-5)
    assert_close(f"{family} tree", ref, compose_tree(ops).apply(s0[0]), 1e-5)
    # Each single operator is also exact against the plain scan from a zero state.
    assert_close(f"{family} E", naive_scan(*spans[0])[0], ops[0].end, 1e-5)


def test_kernel_operator_matches_naive_from_any_state():
    adapter = adapter_for(tiny_model("qwen3_5"))
    k, v, g, b = random_span(50, seed=3, slow=False)
    op = adapter.operator(k, v, g, b, l2norm=True)
    s0 = torch.randn(1, 4, 16, 16)
    assert_close("fast decay span", naive_scan(k, v, g, b, initial_state=s0)[0], op.apply(s0[0]), 1e-5)


@pytest.mark.parametrize("L,dv", [(150, 24), (64, 16), (7, 16)])
def test_scan_with_transition_is_the_kernel_and_its_operator(L, dv):
    """The fused body's kernel (`chunk_scan_with_transition`, T from the UT form) gives the layer
    kernel's output and final state from any state, and the transition of the reference operator
    (the kernel run with values [v | 0] from [0 | I]), with grouped keys and a ragged last chunk."""
    from hypic_core.adapters.gated_deltanet import chunk_scan_with_transition

    adapter = adapter_for(tiny_model("qwen3_5"))
    kernel = adapter.kernels.fallback("torch_chunk_gated_delta_rule")
    k, v, g, b = random_span(L, dv=dv, seed=L)  # slow decay: T far from 0
    q = torch.randn(k.shape, generator=torch.Generator().manual_seed(1))
    s0 = torch.randn(1, 4, 16, dv)
    ref_out, ref_state = kernel(q, k, v, g=g, beta=b, initial_state=s0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    out, state, T = chunk_scan_with_transition(q, k, v, g, b, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert_close("output", ref_out, out, 1e-6)
    assert_close("final state", ref_state, state, 1e-6)
    op = adapter.operator(k, v, g, b, l2norm=True)
    assert_close("T", op.transition, T[0], 1e-5)
    assert_close("T S0 + E", naive_scan(k, v, g, b, initial_state=s0)[0], op.end + T[0] @ s0[0], 1e-5)


def test_scalar_operators_compose():
    g = torch.Generator().manual_seed(0)
    decays = [torch.rand(3, generator=g) for _ in range(32)]
    inputs = [torch.randn(3, 4, 5, generator=g) for _ in range(32)]
    ops = [LinearOperator(a, b) for a, b in zip(decays, inputs)]
    s = torch.randn(3, 4, 5, generator=g)
    ref = s.clone()
    for a, b in zip(decays, inputs):
        ref = a[:, None, None] * ref + b
    assert_close("scalar", ref, compose(ops).apply(s), 1e-5)


def test_identity_operator_is_neutral():
    op = LinearOperator(torch.randn(2, 4, 4), torch.randn(2, 4, 3))
    ident = LinearOperator.identity_like(op)
    s = torch.randn(2, 4, 3)
    assert torch.allclose(ident.then(op).apply(s), op.apply(s))
    assert torch.allclose(op.then(ident).apply(s), op.apply(s))
