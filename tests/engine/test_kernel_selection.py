"""Kernel selection (hypic_core/adapters/kernels.py): which implementation each linear layer's ops run.

- On CPU every family runs its torch fallbacks, and every op an adapter names exists in its modeling module.
- With a package kernel present (simulated: a fake `fla` / `causal_conv1d` / `mamba_ssm` module,
  the op re-decorated by transformers' own `use_kernel_func_from_hub_with_fallback`, exactly what
  importing the modeling module does when the package imports), plain forwards call the fake
  kernel, while capture, fused capture and stitch forwards never do and give the same operators
  and logits as without it.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import inspect
import sys
import types

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.adapters import adapter_for, kernels
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.testing import tiny_model

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h",
           "zamba2", "falcon_h1", "kimi_linear", "minimax"]
WITH_KERNELS = ["qwen3_5", "kimi_linear", "bamba", "falcon_h1"]  # one per adapter with ops, and a parallel hybrid
# modeling-module op -> (function name transformers looks up, package it imports)
HUB_NAMES = {
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d_update", "causal_conv1d"),
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
    "torch_recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule", "fla"),
    "chunk_kimi_delta_attention": ("chunk_kda", "fla"),
    "recurrent_kimi_delta_attention": ("fused_recurrent_kda", "fla"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
    "mamba2_selective_state_update": ("selective_state_update", "mamba_ssm"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
}
SEGMENTS = (14, 40, 31, 23, 9, 6)  # system prompt, four chunks, question
SEAM = 8


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("family", HYBRIDS + ["qwen3"])
def test_cpu_runs_the_torch_fallback_for_every_family(family):
    adapter = adapter_for(tiny_model(family))
    assert set(adapter.kernels.ops) == set(adapter.kernel_ops), "an op the adapter names is missing in transformers"
    plan = adapter.kernel_plan("cpu")
    assert sorted(plan) == adapter.linear_layers
    assert all(impl == "torch" for ops in plan.values() for impl in ops.values()), plan
    assert adapter.kernel_plan() == plan  # the model is on CPU
    for name, op in adapter.kernels.ops.items():  # here no package imports: transformers bound torch code
        package = HUB_NAMES[name][1]
        assert op.fast is None or installed(package)
        if not installed(package):
            assert adapter.kernels.implementation(name, "cuda") == "torch"


def test_torch_fallback_refuses_packed_sequences():
    adapter = adapter_for(tiny_model("qwen3_5"))
    q = torch.randn(1, 4, 2, 16)
    scan = adapter.kernels.fallback("torch_chunk_gated_delta_rule")
    with pytest.raises(ValueError, match="packed"):
        scan(q, q, torch.randn(1, 4, 4, 16), g=torch.zeros(1, 4, 4), beta=torch.ones(1, 4, 4),
             cu_seqlens=torch.tensor([0, 2, 4]))


# --- a package kernel present (simulated) -------------------------------------------------------
def fake_packages(monkeypatch, module, names) -> collections.Counter:
    """Make `module`'s ops look as they do when their packages import; return the fake kernels' call counts.

    Each fake records its call and runs the torch function (same math, so logits can be compared).
    """
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    calls: collections.Counter = collections.Counter()
    packages: dict[str, types.ModuleType] = {}
    for name in names:
        func_name, package = HUB_NAMES[name]
        torch_fn = inspect.unwrap(getattr(module, name))

        def fake(*args, _name=name, _fn=torch_fn, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        fake = functools.wraps(torch_fn)(fake)  # the real kernels' parameter names differ; the filter keeps ours
        fake.__module__ = f"{package}.ops"
        pkg = packages.setdefault(package, types.ModuleType(package))
        setattr(pkg, func_name, fake)
        monkeypatch.setitem(sys.modules, package, pkg)
        monkeypatch.setattr(module, name, use_kernel_func_from_hub_with_fallback(func_name, package)(torch_fn))
    return calls


def scan_op(adapter) -> str:
    return next(n for n in adapter.kernel_ops if "chunk" in n)


@pytest.fixture(params=WITH_KERNELS)
def family(request):
    return request.param


def test_fake_kernel_is_reported_for_cuda_only_and_cpu_forwards_stay_torch(family, monkeypatch):
    model = tiny_model(family)
    module = adapter_for(model)._modeling
    calls = fake_packages(monkeypatch, module, type(adapter_for(model)).kernel_ops)
    adapter = adapter_for(model)
    assert all(isinstance(getattr(module, n), kernels.DeviceDispatch) for n in adapter.kernel_ops)
    adapter_for(model)  # installing again must not stack dispatchers
    assert all(not isinstance(getattr(module, n).op.fast, kernels.DeviceDispatch) for n in adapter.kernel_ops)
    cuda = adapter.kernel_plan("cuda")[adapter.linear_layers[0]]
    assert cuda == {n: HUB_NAMES[n][1] for n in adapter.kernel_ops}
    assert set(adapter.kernel_plan("cpu")[adapter.linear_layers[0]].values()) == {"torch"}
    with torch.no_grad():
        model(input_ids=torch.arange(2, 30)[None])
    assert not calls  # a CPU tensor never reaches a package kernel


def test_plain_forwards_use_the_fake_kernel_and_capture_stitch_do_not(family, monkeypatch):
    segs = random_segments(SEGMENTS, seed=1)
    context, question = segs[:-1], segs[-1]
    ref = run_engine(family, segs)
    ref_ops = reference_operators(family, segs[1])

    monkeypatch.setattr(kernels, "FAST_DEVICE_TYPES", {"cuda", "cpu"})  # let the fake run on CPU tensors
    model = tiny_model(family)
    calls = fake_packages(monkeypatch, adapter_for(model)._modeling, type(adapter_for(model)).kernel_ops)
    engine = engines.engine(SEAM, model=model)
    adapter, runner = engine.adapter, engine.runner
    assert adapter.kernel_plan("cpu")[adapter.linear_layers[0]][scan_op(adapter)] != "torch"
    calls.clear()  # the engine's own probe forward is a plain forward

    with torch.inference_mode():
        entries = runner.compute_entries(context, SEAM, 4096)  # fused body capture for GDN, capture otherwise
        assert not calls, calls
        assert_same_operators(ref_ops, reference_operators(family, segs[1], model))
        assert not calls, calls
        if adapter.supports_fused_stitch:
            runner.stitch(runner.new_cache(), context, entries, question)
            assert not calls, calls
        full = engine.prefill(request(segs, "full")).logits
    assert calls[scan_op(adapter)] > 0  # the plain forward ran the "fast" kernel
    assert (full - ref["full"]).abs().max().item() <= 1e-6
    for mode, seam in (("hypic", SEAM), ("hypic", max(SEGMENTS)), ("pic-naive", SEAM)):
        out = engine.prefill(request(segs, mode, seam)).logits
        assert (out - ref[mode, seam]).abs().max().item() <= 1e-6, (mode, seam)
    assert (ref["hypic", max(SEGMENTS)] - ref["full"]).abs().max().item() <= 1e-4


def request(segs, mode, seam=None):
    return GenerationRequest(tuple(segs), mode=mode, seam=seam, sampling=SamplingParams(max_tokens=1))


def run_engine(family, segs) -> dict:
    engine = engines.engine(SEAM, family)
    out = {"full": engine.prefill(request(segs, "full")).logits}
    for mode, seam in (("hypic", SEAM), ("hypic", max(SEGMENTS)), ("pic-naive", SEAM)):
        out[mode, seam] = engine.prefill(request(segs, mode, seam)).logits
    return out


def reference_operators(family, segment, model=None):
    """Body operators of `segment` on the reference capture path (plain capture, operators afterwards)."""
    model = model or tiny_model(family)
    adapter = adapter_for(model)
    ids = torch.tensor([segment])
    with torch.inference_mode(), adapter.capture(0, len(segment)) as cap:
        model.base_model(input_ids=ids, position_ids=torch.arange(len(segment))[None], cache=adapter.new_cache(),
                         use_cache=True)
    with torch.inference_mode():
        return adapter.span_operators(cap, 0, SEAM, len(segment))


def assert_same_operators(ref, out):
    assert len(ref) == len(out)
    for a, b in zip(ref, out):
        assert torch.equal(a.transition, b.transition) and torch.equal(a.end, b.end)
