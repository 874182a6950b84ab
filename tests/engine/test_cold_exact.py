"""Cold requests served by one exact forward (EngineConfig.cold_prefill), entries computed after.

Invariants, for every linear family and a dense one:
- a pic-mode request that misses every entry, with cold_prefill "exact", gets `full`'s answer:
  its first-token logits and greedy tokens equal full prefill's; all its prompt tokens are fresh
  work (exact + composed + seam + fresh = prompt, with composed = seam = 0);
- the entries it left missing are computed afterwards, off the critical path: none in the step
  that produced its first token, then in the leftover budget of its decode steps (or idle steps);
  they equal the entries the stitched cold path builds (float tolerance) and a following request
  in a new order hits all of them and stitches;
- "stitch" keeps today's path; requests that measure composition (`exact_runs` False) always
  stitch; an aborted request leaves no background work; with exact_repeats a repeat in the same
  order is computed exactly and then restored, equal to full;
- "auto" chooses by the cost model (hypic_core/engine/plan.py), checked on its formula and on the
  engine's choice for an all-miss and a mostly-warm request.
"""

from __future__ import annotations

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.errors import InvalidRequestError
from hypic_core.algebra.keys import SegmentKey
from hypic_core.engine.plan import CostModel, exact_wins
from hypic_core.engine.sequence import Status

FAMILIES = ["qwen3_5", "bamba", "kimi_linear", "minimax", "llama"]
LENGTHS = (12, 40, 33, 27, 9)  # system prompt, three chunks, question
TOL = 2e-4


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return engines.model(request.param)


def engine_of(model, choice="exact", **kw):
    return engines.engine(4, model=model, cold_prefill=choice, **kw)


def req(segments, mode="hypic", max_tokens=1, exact_runs=True):
    return GenerationRequest(tuple(segments), mode=mode, sampling=SamplingParams(max_tokens=max_tokens),
                             exact_runs=exact_runs, keep_logits=True)


def first(engine, request):
    outs = list(engine.generate(request))
    return outs[0], [o.token_id for o in outs if o.token_id is not None]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return a.numel() == 0 or (a.float() - b.float()).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def same_entry(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.seam == b.seam and all(map(close, a.keys, b.keys))
            and all(map(close, a.values, b.values)) and all(map(close, a.conv_tails, b.conv_tails))
            and all(close(x.transition, y.transition) and close(x.end, y.end) for x, y in zip(a.operators, b.operators))
            and len(a.operators) == len(b.operators))


def test_cold_exact_is_full(model):
    segs = random_segments(LENGTHS, seed=1)
    eng = engine_of(model)
    full_out, full_tokens = first(eng, req(segs, "full", max_tokens=6))
    for mode in ("hypic", "pic-naive"):
        cold = engine_of(model)
        out, tokens = first(cold, req(segs, mode, max_tokens=6))
        assert close(out.logits, full_out.logits), mode
        assert tokens == full_tokens, mode
        s = out.stats
        assert s.exact_forward and s.composed_tokens == 0 and s.seam_tokens == 0 and s.exact_tokens == 0
        assert s.fresh_tokens == s.prompt_tokens == sum(LENGTHS)
        assert s.segment_misses == len(LENGTHS) - 1 and s.segment_hits == 0
        assert "cold" not in s.timings_ms and "forward" in s.timings_ms


def test_background_entries_equal_the_cold_path_and_are_hit(model):
    segs = random_segments(LENGTHS, seed=2)
    eng = engine_of(model)
    first(eng, req(segs))
    assert eng.has_background_work() and len(eng.store) == 0  # nothing computed before the first token
    eng.drain_background()
    assert not eng.has_background_work()
    ref = engine_of(model, "stitch")
    out_ref, _ = first(ref, req(segs))  # the stitched cold path computes and stores the same entries
    assert not out_ref.stats.exact_forward
    for seg in segs[:-1]:
        key = SegmentKey.of(eng.fingerprint, 4, seg)
        assert same_entry(eng.store.lookup(key, seg), ref.store.lookup(key, seg))
    shuffled = [segs[0], segs[3], segs[1], segs[2], segs[4]]
    warm, _ = first(eng, req(shuffled))
    warm_ref, _ = first(ref, req(shuffled))
    s = warm.stats
    assert not s.exact_forward and s.segment_hits == len(LENGTHS) - 1 and s.segment_misses == 0
    assert s.composed_tokens == sum(n - 4 for n in LENGTHS[:-1])
    assert s.exact_tokens + s.composed_tokens + s.seam_tokens + s.fresh_tokens == s.prompt_tokens
    assert close(warm.logits, warm_ref.logits)


def test_background_runs_in_decode_steps_not_the_first_token_step(model):
    segs = random_segments(LENGTHS, seed=3)
    eng = engine_of(model, max_step_tokens=64)
    gen = eng.generate(req(segs, max_tokens=8))
    out = next(gen)
    assert out.stats.exact_forward and len(eng.store) == 0
    rest = list(gen)  # decode steps: one token each, the budget's rest goes to the deferred entries
    assert rest[-1].finish_reason is not None
    assert len(eng.store) == len(LENGTHS) - 1 and not eng.has_background_work()


def test_stitch_and_composition_requests_keep_the_stitch(model):
    segs = random_segments(LENGTHS, seed=4)
    for eng, request in ((engine_of(model, "stitch"), req(segs)), (engine_of(model), req(segs, exact_runs=False))):
        out, _ = first(eng, request)
        assert not out.stats.exact_forward and out.stats.seam_tokens > 0
        assert not eng.has_background_work() and len(eng.store) == len(LENGTHS) - 1


def test_partial_miss_stitches_and_shared_work():
    model = engines.model("qwen3_5")
    segs = random_segments(LENGTHS, seed=5)
    eng = engine_of(model)
    eng.segment_entries(tuple(segs[1:2]), 4)  # one chunk warm: not every entry misses
    out, _ = first(eng, req(segs))
    assert not out.stats.exact_forward and out.stats.segment_hits == 1
    # An exact request defers its segments; a stitched request then needs one of them: they share it.
    other = random_segments((10, 30, 7), seed=6)
    a = eng.add_request(req(other, max_tokens=3))
    while a.status is not Status.RUNNING:
        eng.step()
    assert a.stats.exact_forward and eng.has_background_work()
    shared = eng.cache_manager._cold[SegmentKey.of(eng.fingerprint, 4, other[1]).to_str()]
    b, _ = first(eng, req([other[0], segs[1], other[1], other[2]]))
    assert not b.stats.exact_forward and b.stats.segment_hits == 1 and shared.entry is not None
    eng.drain_background()
    for seg in other[:-1]:
        assert eng.store.lookup(SegmentKey.of(eng.fingerprint, 4, seg), seg) is not None
    assert not eng.cache_manager._cold


def test_abort_before_first_token_leaves_no_background_work():
    model = engines.model("bamba")
    segs = random_segments(LENGTHS, seed=7)
    eng = engine_of(model, max_step_tokens=16)
    seq = eng.add_request(req(segs, max_tokens=4))
    eng.step()
    assert seq.stats.exact_forward and seq.prefill is not None and seq.prefill.logits is None
    seq.abort.abort()
    eng.step()
    assert seq.finished and not eng.has_background_work() and not eng.cache_manager._cold and len(eng.store) == 0


def test_exact_repeats_a_repeat_is_exact_then_restored():
    model = engines.model("qwen3_5")
    segs = random_segments(LENGTHS, seed=8)
    eng = engine_of(model, exact_repeats=True)
    out, _ = first(eng, req(segs))
    full, _ = first(eng, req(segs, "full"))
    assert out.stats.exact_forward and close(out.logits, full.logits)
    eng.drain_background()
    second, _ = first(eng, req(segs))  # seen before in this order: an exact run, kept as a snapshot
    third, _ = first(eng, req(segs))
    assert not second.stats.exact_forward and second.stats.composed_tokens == 0 and second.stats.exact_tokens == 0
    assert third.stats.exact_tokens == sum(LENGTHS[:-1])
    assert close(second.logits, full.logits) and close(third.logits, full.logits)


def test_background_queue_is_bounded():
    model = engines.model("qwen3_5")
    eng = engine_of(model, background_tokens=50)
    for seed in (9, 10):
        first(eng, req(random_segments(LENGTHS, seed=seed)))
    queued = eng.cache_manager.pending_background()
    assert sum(len(cw.segment) for cw in queued) <= 50 and eng.cache_manager.background_dropped > 0
    eng.drain_background()
    assert not eng.cache_manager._cold


def test_cost_model_formula_and_choice():
    cost = CostModel(attention=1e-3, entry_overhead=0.3)
    assert cost.forward(100, 0) == pytest.approx(100 + 1e-3 * 100 * 50.5)
    assert cost.entry(100) == pytest.approx(130 + 1e-3 * 100 * 50.5)
    assert cost.entry(100, 100) == 0
    # No cross-chunk attention to save and a transition to pay: the exact forward wins ...
    assert exact_wins(CostModel(0.0, 0.3), 0, 1064, [(512, 0), (512, 0)], 80)
    # ... unless most of the entries are computed already (in flight), or attention dominates.
    assert not exact_wins(CostModel(0.0, 0.3), 0, 1064, [(512, 500), (512, 500)], 80)
    assert not exact_wins(CostModel(1e-3, 0.0), 0, 8 * 512 + 64, [(512, 0)] * 8, 8 * 8 + 64)
    assert not exact_wins(CostModel(0.0, 0.3), 0, 1064, [(512, 0), (512, 0)], 80, workers=2)
    with pytest.raises(InvalidRequestError):
        EngineConfig(cold_prefill="sometimes")


def test_auto_chooses_by_cost():
    model = engines.model("qwen3_5")
    eng = engine_of(model, "auto")
    cost = eng.cache_manager.cost
    assert cost.entry_overhead > 0 and cost.attention > 0
    segs = random_segments(LENGTHS, seed=11)
    out, _ = first(eng, req(segs))
    assert out.stats.exact_forward
    eng.drain_background()
    warm, _ = first(eng, req([segs[0], segs[2], segs[1], segs[3], random_segments((9,), seed=12)[0]]))
    assert not warm.stats.exact_forward and warm.stats.segment_hits == len(LENGTHS) - 1
    dense = engine_of(engines.model("llama"), "auto")
    assert dense.cache_manager.cost.entry_overhead == 0


def test_cold_exact_runs_the_forwards_full_runs(model):
    """By construction: the same forward calls (token counts, positions) in the same steps as `full`."""
    segs = random_segments(LENGTHS, seed=13)

    def calls(mode):
        eng = engine_of(model, max_step_tokens=32)
        seen, forward = [], eng.runner.forward
        eng.runner.forward = lambda ids, start, cache, logits=False: (seen.append((len(ids), start, logits)),
                                                                       forward(ids, start, cache, logits))[1]
        list(eng.generate(req(segs, mode)))
        return seen

    assert calls("hypic") == calls("full")


def test_failed_background_work_is_dropped_not_raised():
    model = engines.model("qwen3_5")
    eng = engine_of(model)
    first(eng, req(random_segments(LENGTHS, seed=14)))
    real = eng.runner.compute_entries
    eng.runner.compute_entries = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    assert eng.step() == [] and isinstance(eng.cache_manager.background_error, RuntimeError)
    assert not eng.has_background_work() and not eng.cache_manager._cold
    eng.runner.compute_entries = real
    out, _ = first(eng, req(random_segments(LENGTHS, seed=15)))  # the engine serves on
    assert out.stats.exact_forward


def test_gateway_serves_cold_exactly_and_its_engine_thread_builds_the_entries(tiny_tokenizer, tmp_path):
    """Through the gateway: a cold /query takes the exact forward (no composed or seam tokens); the
    engine thread then computes the deferred entries while idle, and the same question composes."""
    import json
    import time

    import httpx

    from app.http.server import create_app
    from app.service.settings import Settings
    from app.testing import LiveServer
    from retrieval import HashingEmbedder, VectorIndex

    docs = [{"id": f"d{i}", "text": f"Document {i} says the river number {i} flows north past the town of Varo {i}."}
            for i in range(4)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    settings = Settings(_env_file=None, torch_threads=None, index_dir=tmp_path / "index", corpus_path=tmp_path / "corpus.jsonl",
                        exact_repeats=False)
    engine = engines.engine(4, tokenizer=tiny_tokenizer, model_id="tiny", cold_prefill="exact")
    app = create_app(settings, engine=engine, index=VectorIndex(settings.index_dir, HashingEmbedder(64)))
    ask = {"question": "Which way does the river flow?", "top_k": 3, "max_tokens": 4}
    with LiveServer(app) as live:
        live.wait_ready(timeout=60)
        cold = httpx.post(f"{live.url}/query", json=ask, timeout=60).json()["usage"]
        deadline = time.time() + 30
        while engine.has_background_work() and time.time() < deadline:
            time.sleep(0.05)
        warm = httpx.post(f"{live.url}/query", json=ask, timeout=60).json()["usage"]
        metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
    assert 'hypic_cold_exact_forwards_total{model_name="tiny"} 1.0' in metrics
    assert cold["composed_tokens"] == 0 and cold["seam_tokens"] == 0, cold
    assert warm["composed_tokens"] > 0, warm
