"""The lean decode step (hypic_core/runner/decode_step.py) against the module path, its reference.

Per family of hypic_core/testing.py: rows join and leave the decode batch between steps; every
step's fp32 logits agree within 1e-4 with each sequence advanced alone through the HF modules,
and greedy tokens are identical step for step. Families the step does not cover fall back to the
module path, with the reason said. Then the engine with `decode_step="lean"` against "module",
and the real SmolLM2 and its distilled hybrid.
"""

from __future__ import annotations

import copy

import pytest
import torch

import engines
from conftest import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.errors import InvalidRequestError
from hypic_core.runner.decode_step import LeanDecodeStep, uncovered_reason
from hypic_core.testing import FAMILIES, tiny_model
from test_batching import MODES, SHAPES, assert_close  # the batching tests' six prompts and comparison

COVERED = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba")


def batch_against_module(engine: Engine, requests, steps: int, join_at: int, leave_at: int):
    """Decode `requests` (prefilled) in the batch on the engine's decode step, rows 4.. joining at `join_at`
    and row 1 leaving at `leave_at`; yields (row, step, reference logits, batch logits) for each row each
    step, the reference being the row's own cache advanced through the HF modules. The reference's greedy
    token is fed on; the batch is emptied at the end."""
    runner = engine.runner
    pre = [engine.prefill(r) for r in requests]
    ref_caches = [copy.deepcopy(p.cache) for p in pre]
    caches = {i: p.cache for i, p in enumerate(pre)}
    pos = [p.position for p in pre]
    tokens = [int(p.logits.argmax()) for p in pre]
    members = [0, 1, 2, 3][: len(pre)]
    with torch.inference_mode():
        for step in range(steps):
            if step == join_at:
                members += list(range(4, len(pre)))
            if step == leave_at:
                members.remove(1)
            runner.batch.sync(members, {i: caches[i] for i in members})
            rows = runner.batch.forward([tokens[i] for i in runner.batch.keys], [pos[i] for i in runner.batch.keys])
            for i, lg in zip(runner.batch.keys, rows):
                ref = runner.forward([tokens[i]], pos[i], ref_caches[i], logits=True)
                yield i, step, ref, lg
                tokens[i], pos[i] = int(ref.argmax()), pos[i] + 1
        runner.batch.sync([], {})


def lean_against_module(engine: Engine, requests, steps: int, join_at: int, leave_at: int, atol: float = 1e-4) -> int:
    """`batch_against_module` with the lean step: every row's logits within `atol` of the modules' and the
    same greedy token. Returns the number of rows compared."""
    compared = 0
    for i, step, ref, lg in batch_against_module(engine, requests, steps, join_at, leave_at):
        assert_close(f"seq {i} step {step}", ref, lg, atol)
        assert int(lg.argmax()) == int(ref.argmax()), f"seq {i} step {step}: greedy token differs"
        compared += 1
    return compared


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_step_equals_module_path(family):
    """Every covered family: logits within 1e-4 and the same greedy tokens over joins and leaves.
    An uncovered one: the engine keeps the module path and says why."""
    engine = engines.engine(3, family, decode_step="lean")
    if family not in COVERED:
        assert uncovered_reason(engine.model) is not None and engine.runner.batch.step is None
        assert engine.runner.decode_step == "module"
        pytest.skip(f"{family}: {uncovered_reason(engine.model)}")
    assert engine.runner.decode_step == "lean" and engine.runner.batch.step is not None
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    assert lean_against_module(engine, reqs, steps=6, join_at=2, leave_at=3) == 4 + 4 + 6 + 5 + 5 + 5


def test_lean_step_writes_the_row_buffers_in_place():
    """A steady step (no join, no growth) moves no buffer: K/V columns and states are written where they live."""
    engine = engines.engine(3, "bamba", decode_step="lean")
    pre = [engine.prefill(GenerationRequest(random_segments(s, seed=i))) for i, s in enumerate(((6, 4), (9, 2)))]
    batch = engine.runner.batch
    with torch.inference_mode():
        batch.sync([0, 1], {0: pre[0].cache, 1: pre[1].cache})
        before = [b.data_ptr() for b in batch.buffers()]
        for step in range(3):
            batch.forward([3, 4], [pre[0].position + step, pre[1].position + step])
        assert [b.data_ptr() for b in batch.buffers()] == before
        assert batch.lengths == [pre[0].position + 3, pre[1].position + 3]


def test_fused_weights_are_the_modules_own():
    """Fusing QKV and gate-up makes the modules' parameters views of the fused weight: no second copy,
    and the module path computes with the same numbers."""
    model = tiny_model("llama")
    q = model.model.layers[0].self_attn.q_proj.weight.clone()
    step = LeanDecodeStep.build(model, engines.engine(8, model=model).adapter)
    attn = step.layers[0][1]
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == attn.qkv.w.data_ptr()


def test_engine_lean_equals_module_tokens():
    """Whole engine, six requests of different modes decoded together (two joining late): the lean
    step gives the module path's tokens and top-5 logprobs (1e-4)."""
    model = tiny_model("qwen3_5")
    reqs = [GenerationRequest(random_segments(s, seed=10 + i), mode=m,
                              sampling=SamplingParams(max_tokens=n, top_logprobs=5, ignore_eos=True))
            for i, (s, m, n) in enumerate(zip(SHAPES, MODES, (9, 4, 12, 7, 10, 6)))]
    outs = {}
    for kind in ("module", "lean"):
        engine = engines.engine(3, model=model, decode_step=kind)
        seqs = [engine.add_request(r) for r in reqs[:4]]
        got: dict[str, list] = {}
        for n in range(1000):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                got.setdefault(o.request_id, []).append(o)
            if n == 1:
                seqs += [engine.add_request(r) for r in reqs[4:]]
        outs[kind] = [got[s.request_id] for s in seqs]
    for i, (ref, out) in enumerate(zip(outs["module"], outs["lean"])):
        assert [o.token_id for o in out] == [o.token_id for o in ref], f"request {i}"
        for a, b in zip(ref, out):
            assert_close(f"request {i} token {a.index}", torch.tensor([v for _, v in a.top_logprobs]),
                         torch.tensor([v for _, v in b.top_logprobs]))


def test_decode_step_setting_is_validated():
    with pytest.raises(InvalidRequestError, match="decode_step"):
        EngineConfig(decode_step="fast")
    with pytest.raises(InvalidRequestError, match="decode_step.*lean-packed was removed"):
        EngineConfig(decode_step="lean-packed")


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "smollm2-hybrid-135m"])
def test_lean_step_on_the_real_models(name, smollm2_dir):
    """The real SmolLM2 (dense llama) and its distilled hybrid (bamba: 13 Mamba2 mixers): 4 rows, one
    joining and one leaving, 4 steps, fp32 logits within 1e-4 and the same greedy tokens."""
    from hypic_core.models.registry import resolve

    torch.set_num_threads(1)
    engine = Engine.from_pretrained(resolve(name).path, EngineConfig(seam=4, decode_step="lean"))
    assert engine.runner.decode_step == "lean"
    reqs = [GenerationRequest(random_segments(s, vocab=40000, seed=i, low=10), mode=m)
            for i, (s, m) in enumerate(zip(((12, 6), (20, 4), (7,), (16, 8, 3), (10, 5)), MODES))]
    assert lean_against_module(engine, reqs, steps=4, join_at=1, leave_at=2) == 4 + 5 + 4 + 4


def test_gateway_setting_reads_hypic_decode_step(monkeypatch):
    """The gateway decodes with the lean step unless HYPIC_DECODE_STEP=module (read in app settings only)."""
    from pydantic import ValidationError

    from app.service.settings import Settings

    monkeypatch.delenv("HYPIC_DECODE_STEP", raising=False)
    assert Settings(_env_file=None, torch_threads=None).decode_step == "lean"
    monkeypatch.setenv("HYPIC_DECODE_STEP", "module")
    assert Settings(_env_file=None, torch_threads=None).decode_step == "module"
    monkeypatch.setenv("HYPIC_DECODE_STEP", "lean-packed")  # measured and removed: refused, naming the setting
    with pytest.raises(ValidationError, match="decode_step"):
        Settings(_env_file=None, torch_threads=None)


def test_decoding_seam_steps_the_rows_and_leaves_the_batch_empty():
    """`ModelRunner.decoding` (the benchmarks' seam, bench/harness.py): each row advanced by one token as the
    module path advances it alone, nothing left in the batch after, and refused while rows are decoding."""
    engine = engines.engine(3, "bamba", decode_step="lean")
    pre = [engine.prefill(GenerationRequest(random_segments(s, seed=i), mode="full")) for i, s in enumerate(SHAPES[:2])]
    ref = [copy.deepcopy(p.cache) for p in pre]
    with torch.inference_mode():
        with engine.runner.decoding([p.cache for p in pre]) as step:
            got = step([3, 4], [p.position for p in pre])
            with pytest.raises(RuntimeError, match="idle decode batch"):
                with engine.runner.decoding([]):
                    pass
        assert len(engine.runner.batch) == 0
        for i, p in enumerate(pre):
            assert_close(f"row {i}", engine.runner.forward([3 + i], p.position, ref[i], logits=True), got[i])
