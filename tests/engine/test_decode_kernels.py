"""The native decode matmuls (hypic_core/native/decode_matmul.py) and the lean step on them.

- The kernels against their plain torch reference, fp32 and fp16 weights, 1-17 rows, shapes with
  tails (in not a multiple of 8, out not of 4), with and without a bias.
- `kernel="native"` (fp32): fp32 logits within 1e-4 of the module path and identical greedy tokens,
  step for step with rows joining and leaving, on every family the lean step covers and on the
  real SmolLM2 and its hybrid; the verification forward of speculative decoding runs the same
  kernel and still equals the step fed one token at a time.
- `kernel="native-f16"` and `"native-i8"` (lossy): the logit error against fp32 is bounded.
- No compiler: the step keeps torch's matmuls and a warning says why.
- The gateway setting HYPIC_DECODE_KERNEL.
"""

from __future__ import annotations

import collections
import copy
import logging

import pytest
import torch

from hypic_core.config import EngineConfig, GenerationRequest
from hypic_core.engine.engine import Engine
from hypic_core.native import decode_matmul
from hypic_core.runner.decode_step import LeanDecodeStep
from hypic_core.runner.ops import NativeOps
from hypic_core.runner.verify_step import VerifyStep
from hypic_core.testing import tiny_model

import engines
from engines import random_segments
from test_decode_step import batch_against_module

COVERED = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba")
SHAPES = ((5, 9), (12, 30, 7), (40, 3), (8, 8, 8, 8, 4), (25, 60, 11), (2,))
MODES = ("full", "prefix", "pic-naive", "hypic", "hypic", "full")
NATIVE = decode_matmul.native()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the native kernels cannot be built here (no compiler or no AVX2)")


def engine_on(model, kernel: str, **config) -> Engine:
    """An engine on `model` whose lean decode step runs `kernel` (EngineConfig.decode_kernel)."""
    return engines.engine(seam=3, model=model, decode_step="lean", decode_kernel=kernel, **config)


def decode_against_module(engine: Engine, requests, steps: int, join_at: int, leave_at: int):
    """test_decode_step's walk over joins and leaves (`batch_against_module`), summed up: (largest |logit
    difference|, greedy tokens that differ, rows compared)."""
    worst, differ, compared = 0.0, 0, 0
    for _, _, ref, lg in batch_against_module(engine, requests, steps, join_at, leave_at):
        worst = max(worst, (ref - lg).abs().max().item())
        differ += int(lg.argmax()) != int(ref.argmax())
        compared += 1
    return worst, differ, compared


# --- the kernels ----------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("out,n", [(1536, 576), (7, 13), (576, 1536), (5, 8), (49, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_kernels_equal_the_reference(out, n, rows):
    g = torch.Generator().manual_seed(rows * 1000 + out)
    x = torch.randn(rows, n, generator=g)
    w = torch.randn(out, n, generator=g) / n ** 0.5
    b = torch.randn(out, generator=g)
    for weight in (w, w.half()):
        for bias in (None, b):
            got = NATIVE.linear(x, weight, bias)
            ref = decode_matmul.reference(x, weight, bias)
            err = (got - ref).abs().max().item()
            assert got.shape == (rows, out) and err < 1e-4, f"{weight.dtype} bias={bias is not None}: {err:.3g}"
    q, scales = decode_matmul.quantize_int8(w)
    for bias in (None, b):  # int8: the dequantized product, exactly up to summation order
        got = NATIVE.linear(x, q, bias, scales)
        err = (got - decode_matmul.reference(x, q, bias, scales)).abs().max().item()
        assert got.shape == (rows, out) and err < 1e-4, f"int8 bias={bias is not None}: {err:.3g}"
    if n % decode_matmul.Q8_GROUP == 0:  # int8 with a scale per 32 weights of a row: the same, per group
        q, scales = decode_matmul.quantize_int8(w, decode_matmul.Q8_GROUP)
        for bias in (None, b):
            got = NATIVE.linear(x, q, bias, scales)
            err = (got - decode_matmul.reference(x, q, bias, scales)).abs().max().item()
            assert got.shape == (rows, out) and err < 1e-4, f"int8 group bias={bias is not None}: {err:.3g}"


def test_int8_quantization_is_per_row_and_bounded():
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1, 10, 0, 5, 2])[:, None]
    q, scales = decode_matmul.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (6,) and int(q.abs().max()) == 127
    back = q.float() * scales[:, None]
    assert ((back - w).abs() <= scales[:, None] / 2 + 1e-12).all()  # within half a step of each row's grid
    assert torch.equal(back[3], torch.zeros(40))  # an all-zero row stays zero


def test_int8_group_quantization_is_per_group_and_closer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g)
    w[:, :32] *= 0.01  # each row's first group is 100x smaller than its second
    q, scales = decode_matmul.quantize_int8(w, 32)
    assert q.dtype == torch.int8 and scales.shape == (6, 2)
    assert (q[:, :32].abs().amax(1) == 127).all() and (q[:, 32:].abs().amax(1) == 127).all()  # each group's own grid
    back = decode_matmul.dequantize_int8(q, scales)
    assert ((back - w).abs() <= scales.repeat_interleave(32, dim=1) / 2 + 1e-12).all()
    rows = decode_matmul.dequantize_int8(*decode_matmul.quantize_int8(w))
    assert (back - w)[:, :32].abs().max() < 0.05 * (rows - w)[:, :32].abs().max()  # the small group kept
    with pytest.raises(ValueError, match="group"):
        decode_matmul.quantize_int8(w[:, :40], 32)


@needs_native
def test_kernel_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous fp32 x"):
        NATIVE.linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous fp32 x"):
        NATIVE.linear(torch.randn(2, 8), torch.randn(8, 4).t())  # a transposed view
    with pytest.raises(ValueError, match="bias"):
        NATIVE.linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3))
    with pytest.raises(ValueError, match="scales"):
        NATIVE.linear(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8))  # int8 without its scales
    with pytest.raises(ValueError, match="per group of 32"):  # group scales of the wrong shape
        NATIVE.linear(torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.int8), None, torch.ones(4, 3))
    with pytest.raises(ValueError, match="per group of 32"):  # a row length that is no multiple of the group
        NATIVE.linear(torch.randn(2, 40), torch.zeros(4, 40, dtype=torch.int8), None, torch.ones(4, 1))


def test_no_compiler_keeps_torch_matmuls_with_a_warning(monkeypatch, caplog, tmp_path):
    """Without a C++ compiler and nothing built in the kernels directory, the kernels are not had: `native`
    says why (one warning) and returns None, and a step asked for kernel "native" runs torch's matmuls, exactly."""
    monkeypatch.setattr(decode_matmul, "_built", {})
    monkeypatch.setattr(decode_matmul, "_compiler", lambda: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("HYPIC_KERNELS_DIR", str(tmp_path / "kernels"))
    with caplog.at_level(logging.WARNING, logger="hypic.decode_matmul"):
        assert decode_matmul.native() is None
    assert "no C++ compiler found" in caplog.text and len(caplog.records) == 1
    assert decode_matmul.kernel_status()["state"] == "unavailable"
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found"):
        decode_matmul.build(compiler="/nonexistent/g++", directory=tmp_path / "empty")
    engine = engine_on(tiny_model("bamba"), "native")
    step = engine.runner.batch.step
    assert isinstance(step, LeanDecodeStep) and step.kernel == "torch" and not isinstance(step.ops, NativeOps)
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    worst, differ, _ = decode_against_module(engine, reqs, steps=3, join_at=1, leave_at=2)
    assert worst <= 1e-4 and differ == 0


def test_kernel_name_is_checked():
    with pytest.raises(ValueError, match="decode kernel must be one of"):
        LeanDecodeStep.build(tiny_model("llama"), Engine(tiny_model("llama")).adapter, kernel="avx9")


# --- the lean step on them -----------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("family", COVERED)
def test_native_step_equals_module_path(family):
    """kernel="native": every covered family, logits within 1e-4 and the same greedy tokens over joins
    and leaves; the weights the step streams are the modules' own [out, in] rows (no second copy)."""
    model = tiny_model(family)
    engine = engine_on(model, "native")
    step = engine.runner.batch.step
    assert step.kernel == "native" and isinstance(step.ops, NativeOps) and step.lm_head.w.dtype == torch.float32
    assert model.get_output_embeddings().weight.data_ptr() == step.lm_head.w.data_ptr()
    calls = collections.Counter()
    step.ops = CountingOps(step.ops, calls)  # the step's other ops run native too (tests/engine/test_decode_ops.py)
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    worst, differ, compared = decode_against_module(engine, reqs, steps=6, join_at=2, leave_at=3)
    assert compared == 4 + 4 + 6 + 5 + 5 + 5
    assert worst <= 1e-4 and differ == 0, f"{family}: max |logit diff| {worst:.3g}, {differ} greedy tokens differ"
    # each layer's parts run as the table's blocks (one native call each where they can: test_decode_ops.py)
    assert calls["attention_block"] and calls["norm_linear"]
    assert calls["mlp_block"] or all(mlp.module is not None for *_, mlp in step.layers)  # MoE MLPs run as their module
    assert calls["mamba2_block"] or family != "bamba"


class CountingOps:
    """The native ops, each call counted by name."""

    def __init__(self, ops, calls: collections.Counter):
        self.ops, self.calls = ops, calls

    def __getattr__(self, name):
        fn = getattr(self.ops, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


@needs_native
@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_verification_runs_the_native_kernel(family, monkeypatch):
    """Speculation's verification forward (rows of 1 + drafts tokens) multiplies on the same native
    weights, and its logits equal the native step fed the same tokens one at a time (1e-4)."""
    engine = engine_on(tiny_model(family), "native")
    runner = engine.runner
    calls = []
    linear = decode_matmul.NativeMatmul.linear

    def counted(self, x, w, b=None, scales=None):
        calls.append(x.shape[0])
        return linear(self, x, w, b, scales)

    monkeypatch.setattr(decode_matmul.NativeMatmul, "linear", counted)
    pre = [engine.prefill(GenerationRequest(random_segments(s, seed=i), mode="full")) for i, s in enumerate(SHAPES[:3])]
    fed = [[3, 17, 40], [9], [11, 12, 13, 14, 15]]
    with torch.inference_mode():
        ref = copy.deepcopy([p.cache for p in pre])
        runner.batch.sync([0, 1, 2], dict(enumerate(p.cache for p in pre)))
        verified = VerifyStep.build(runner.batch).verify(runner.batch, fed, [p.position for p in pre])
        assert 9 in calls  # the 3 + 1 + 5 tokens went through the native kernel
        runner.batch.sync([], {})
        runner.batch.sync([0, 1, 2], dict(enumerate(ref)))
        pos = [p.position for p in pre]
        for t in range(5):
            live = [r for r in range(3) if t < len(fed[r])]
            runner.batch.sync(live, {})
            logits = runner.batch.forward([fed[r][t] for r in runner.batch.keys], [pos[r] + t for r in runner.batch.keys])
            for r, lg in zip(runner.batch.keys, logits):
                err = (lg - verified.logits[r, t]).abs().max().item()
                assert err < 1e-4, f"{family} row {r} token {t}: {err:.3g}"
        runner.batch.sync([], {})


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_native_f16_logits_stay_near_fp32(family):
    """kernel="native-f16" (fp16 copies of the weights): lossy, so bounded, not exact; the fp32 weights the
    modules and the prefill use are untouched."""
    model = tiny_model(family)
    before = model.get_output_embeddings().weight.detach().clone()
    engine = engine_on(model, "native-f16")
    step = engine.runner.batch.step
    assert step.kernel == "native-f16" and step.lm_head.w.dtype == torch.float16
    assert torch.equal(model.get_output_embeddings().weight, before) and model.dtype == torch.float32
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    worst, _, _ = decode_against_module(engine, reqs, steps=6, join_at=2, leave_at=3)
    assert 2e-5 < worst < 1e-2, f"{family}: max |logit diff| {worst:.3g}"  # measured 1.6e-4 to 2.8e-3


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_native_i8_logits_stay_near_fp32(family):
    """kernel="native-i8" (per-row int8 copies of the weights): lossier than fp16, still bounded; the fp32
    weights are untouched."""
    model = tiny_model(family)
    before = model.get_output_embeddings().weight.detach().clone()
    engine = engine_on(model, "native-i8")
    step = engine.runner.batch.step
    assert step.kernel == "native-i8" and step.lm_head.w.dtype == torch.int8 and step.lm_head.scales is not None
    assert torch.equal(model.get_output_embeddings().weight, before) and model.dtype == torch.float32
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    worst, _, _ = decode_against_module(engine, reqs, steps=6, join_at=2, leave_at=3)
    assert 1e-4 < worst < 0.1, f"{family}: max |logit diff| {worst:.3g}"


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_native_q8_logits_stay_nearer_fp32_than_per_row_int8(family):
    """kernel="native-q8" (int8 copies with a scale per 32 weights of a row, where a row's length allows):
    bounded like native-i8 and no farther from the fp32 module path than it on the same requests."""
    model = tiny_model(family)
    reqs = lambda: [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    engine = engine_on(model, "native-q8")
    step = engine.runner.batch.step
    assert step.kernel == "native-q8" and step.lm_head.w.dtype == torch.int8
    n = step.lm_head.w.shape[1]
    assert step.lm_head.scales.shape == ((step.lm_head.w.shape[0], n // 32) if n % 32 == 0 else (step.lm_head.w.shape[0],))
    worst, _, _ = decode_against_module(engine, reqs(), steps=6, join_at=2, leave_at=3)
    rows, _, _ = decode_against_module(engine_on(tiny_model(family), "native-i8"), reqs(), steps=6, join_at=2, leave_at=3)
    assert 0 < worst < 0.1 and worst <= rows * 1.05, f"{family}: q8 {worst:.3g}, per-row {rows:.3g}"


@needs_native
@pytest.mark.parametrize("name,kernel,bound", [("smollm2-135m-instruct", "native", 1e-4), ("smollm2-hybrid-135m", "native", 1e-4),
                                               ("smollm2-hybrid-135m", "native-f16", 0.1),
                                               ("smollm2-hybrid-135m", "native-i8", 2.0),
                                               ("smollm2-hybrid-135m", "native-q8", 1.0)])
def test_native_step_on_the_real_models(name, kernel, bound):
    """The real SmolLM2 (dense llama) and its distilled hybrid (bamba): 4 rows, one joining and one
    leaving, 4 steps. fp32 weights: logits within 1e-4 and the same greedy tokens; fp16 copies: the
    logit error bounded."""
    from hypic_core.models.registry import resolve

    torch.set_num_threads(2)
    engine = Engine.from_pretrained(resolve(name).path, EngineConfig(seam=4))
    engine.runner.use_decode_step("lean", kernel=kernel)
    assert engine.runner.batch.step.kernel == kernel
    reqs = [GenerationRequest(random_segments(s, vocab=40000, seed=i, low=10), mode=m)
            for i, (s, m) in enumerate(zip(((12, 6), (20, 4), (7,), (16, 8, 3), (10, 5)), MODES))]
    worst, differ, compared = decode_against_module(engine, reqs, steps=4, join_at=1, leave_at=2)
    assert compared == 4 + 5 + 4 + 4
    assert worst <= bound, f"{name} {kernel}: max |logit diff| {worst:.3g}"
    if kernel == "native":
        assert differ == 0


# --- the gateway setting ---------------------------------------------------------------------------
def test_gateway_setting_reads_hypic_decode_kernel(monkeypatch):
    from pydantic import ValidationError

    from app.service.settings import Settings

    monkeypatch.delenv("HYPIC_DECODE_KERNEL", raising=False)
    assert Settings(_env_file=None, torch_threads=None).decode_kernel == "native"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "torch")
    assert Settings(_env_file=None, torch_threads=None).decode_kernel == "torch"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "native-f16")
    assert Settings(_env_file=None, torch_threads=None).decode_kernel == "native-f16"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "native-i8")
    assert Settings(_env_file=None, torch_threads=None).decode_kernel == "native-i8"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "native-bf16")
    assert Settings(_env_file=None, torch_threads=None).decode_kernel == "native-bf16"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "avx9")
    with pytest.raises(ValidationError, match="decode_kernel"):
        Settings(_env_file=None, torch_threads=None)


@needs_native
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_the_gateway_setting_reaches_the_step(kernel, monkeypatch, tmp_path):
    """HYPIC_DECODE_KERNEL reaches the lean step the gateway's engine decodes with (the bundled model)."""
    from pathlib import Path

    from app.service.runtime import load_engine
    from app.service.settings import Settings

    tiny = Path(__file__).resolve().parents[2] / "models" / "hypic-tiny"
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", kernel)
    engine = load_engine(Settings(model=str(tiny), index_dir=tmp_path / "index", cache_dir=tmp_path / "cache"))
    assert engine.runner.decode_step == "lean" and engine.runner.batch.step.kernel == kernel


def test_the_engine_builds_its_step_on_the_configured_kernel_and_names_a_bad_one():
    from hypic_core.config import EngineConfig
    from hypic_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="decode_kernel"):
        EngineConfig(decode_kernel="int4")
    for kernel in ("torch", "native"):
        eng = engines.engine(decode_step="lean", decode_kernel=kernel)
        assert eng.runner.decode_step == "lean" and eng.config.decode_kernel == kernel
        assert eng.runner.batch.step.kernel == (kernel if decode_matmul.native() is not None else "torch")
