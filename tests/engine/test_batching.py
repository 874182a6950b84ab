"""Continuous batching: one decode forward for every running sequence equals decoding each alone.

Reference = the plain path: each sequence's own cache advanced by `runner.forward`, one token
at a time. Batched = `DecodeBatch`, rows joining and leaving between steps, and the whole
engine (`Engine.step`) against each request generated alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

import engines
from conftest import random_segments
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.errors import InvalidRequestError
from hypic_core.testing import FAMILIES

MODES = ("full", "prefix", "pic-naive", "hypic", "hypic", "full")
SHAPES = ((5, 9), (12, 30, 7), (40, 3), (8, 8, 8, 8, 4), (25, 60, 11), (2,))  # 6 prompts of different lengths


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float = 1e-4) -> None:
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = (ref - out).abs().max().item() if ref.numel() else 0.0
    assert err <= atol, f"{name}: max abs error {err:.3g} > {atol}"


def prefilled(engine: Engine, seed: int = 0):
    """Six prefilled requests of different lengths and modes: (cache, position, first logits)."""
    out = []
    for i, (shape, mode) in enumerate(zip(SHAPES, MODES)):
        req = GenerationRequest(random_segments(shape, seed=seed + i), mode=mode)
        r = engine.prefill(req)
        out.append((r.cache, r.position, r.logits))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_at_a_time(family):
    """Rows join (2 late) and leave (1 early) between steps; every step's logits match the plain path."""
    engine = engines.engine(3, family)
    if not engine.adapter.supports_batched_decode:
        pytest.skip(f"{family} decodes one sequence per forward")
    runner = engine.runner
    seqs = prefilled(engine)
    ref_caches = [copy.deepcopy(c) for c, _, _ in seqs]
    caches = {i: c for i, (c, _, _) in enumerate(seqs)}
    pos = [p for _, p, _ in seqs]
    tokens = [int(lg.argmax()) for _, _, lg in seqs]
    members = [0, 1, 2, 3]
    with torch.inference_mode():
        for step in range(6):
            if step == 2:
                members += [4, 5]  # join
            if step == 3:
                members.remove(1)  # leave
            runner.batch.sync(members, {i: caches[i] for i in members})
            rows = runner.batch.forward([tokens[i] for i in runner.batch.keys], [pos[i] for i in runner.batch.keys])
            for i, lg in zip(runner.batch.keys, rows):
                ref = runner.forward([tokens[i]], pos[i], ref_caches[i], logits=True)
                assert_close(f"{family} seq {i} step {step}", ref, lg)
                tokens[i], pos[i] = int(ref.argmax()), pos[i] + 1


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return engines.engine(3, tokenizer=tiny_tokenizer)


def requests(engine, max_tokens=(9, 4, 12, 7, 10, 6)):
    vocab = len(engine.tokenizer)
    return [GenerationRequest(random_segments(shape, vocab=vocab, seed=10 + i), mode=mode,
                              sampling=SamplingParams(max_tokens=n, top_logprobs=5, ignore_eos=True))
            for i, (shape, mode, n) in enumerate(zip(SHAPES, MODES, max_tokens))]


def run_together(engine: Engine, reqs, late: int = 0) -> dict[int, list]:
    """Drive `engine.step()` with every request (the last `late` added after two steps); outputs by request."""
    seqs = [engine.add_request(r) for r in reqs[: len(reqs) - late]]
    out: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
        steps += 1
        if steps == 2 and late:
            seqs += [engine.add_request(r) for r in reqs[len(reqs) - late:]]
    return {i: out[s.request_id] for i, s in enumerate(seqs)}


def test_engine_batch_equals_each_request_alone(engine):
    """Six requests of different lengths and modes decoded together (two joining late): greedy tokens
    equal, and the reported top-5 logprobs agree to 1e-4, against each request generated alone."""
    reqs = requests(engine)
    alone = [list(engine.generate(r)) for r in reqs]
    together = run_together(engine, reqs, late=2)
    assert max(len(engine.runner.batch), 0) == 0  # everyone left the batch
    for i, ref in enumerate(alone):
        got = together[i]
        assert [o.token_id for o in got] == [o.token_id for o in ref], f"request {i}"
        assert got[-1].finish_reason == ref[-1].finish_reason == "length"
        for a, b in zip(ref, got):
            assert_close(f"request {i} token {a.index}", torch.tensor([v for _, v in a.top_logprobs]),
                         torch.tensor([v for _, v in b.top_logprobs]))


def test_decode_runs_one_forward_per_step_for_all_running(engine, monkeypatch):
    calls = []
    forward = engine.runner.batch.forward
    monkeypatch.setattr(engine.runner.batch, "forward", lambda ids, pos: calls.append(len(ids)) or forward(ids, pos))
    run_together(engine, requests(engine, max_tokens=(5,) * 6))
    assert max(calls) == 6 and len(calls) <= 5  # 4 decode steps for all six after the prefill step(s)


def test_min_tokens_and_ignore_eos_hold_eos_back(engine):
    """The model's favourite first token is made EOS: without the extras the answer stops at once."""
    seg = random_segments((10, 4), vocab=len(engine.tokenizer), seed=3)
    first = engine.generated_tokens(GenerationRequest(seg, sampling=SamplingParams(max_tokens=1)))[0]
    eng = engines.engine(like=engine)
    eng.eos_ids = frozenset({first})
    stopped = list(eng.generate(GenerationRequest(seg, sampling=SamplingParams(max_tokens=6))))
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop"
    held = list(eng.generate(GenerationRequest(seg, sampling=SamplingParams(max_tokens=6, min_tokens=3))))
    assert len(held) >= 3 and all(o.token_id != first for o in held[:3])
    ignored = list(eng.generate(GenerationRequest(seg, sampling=SamplingParams(max_tokens=6, ignore_eos=True))))
    assert len(ignored) == 6 and ignored[-1].finish_reason == "length" and first not in [o.token_id for o in ignored]


# --- chunked prefill -------------------------------------------------------------------------
LINEAR_FAMILIES = [f for f in FAMILIES if f not in ("qwen3", "llama")]


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_entry_computed_piece_by_piece_equals_whole(family):
    """A long cold segment split over steps: its entry equals the one-forward reference entry."""
    engine = engines.engine(5, family)
    (seg,) = random_segments((45,), seed=4)
    with torch.inference_mode():
        (ref,) = engine.runner.compute_entries_reference([seg], 5)
        part, entry = engine.runner.start_entry(seg, 5), None
        for n in (3, 7, 16, 16, 16):  # piece edges inside the seam head and the body
            entry = engine.runner.advance_entry(part, n)
    assert entry is not None and entry.seam == ref.seam
    for j, (a, b) in enumerate(zip(ref.keys, entry.keys)):
        assert_close(f"keys {j}", a, b, 1e-5)
        assert_close(f"values {j}", ref.values[j], entry.values[j], 1e-5)
    for p, (a, b) in enumerate(zip(ref.operators, entry.operators)):
        assert_close(f"T {p}", a.transition, b.transition, 1e-4)
        assert_close(f"E {p}", a.end, b.end, 1e-4)
        assert_close(f"conv tail {p}", ref.conv_tails[p], entry.conv_tails[p], 1e-5)


@pytest.mark.parametrize("mode", ["full", "prefix", "pic-naive", "hypic"])
def test_chunked_prefill_equals_one_shot(engine, mode):
    """A 16-token step budget spreads the prompt over many steps; outputs equal the unbudgeted engine."""
    small = engines.engine(3, like=engine, max_step_tokens=16)
    segs = random_segments((7, 50, 23, 40, 30), vocab=len(engine.tokenizer), seed=21)
    req = GenerationRequest(segs, mode=mode, sampling=SamplingParams(max_tokens=5, top_logprobs=5, ignore_eos=True))
    for _ in range(2):  # cold, then warm (exact snapshots and segment entries reused)
        ref = list(engines.engine(3, like=engine).generate(req))
        got = list(small.generate(req))
        assert [o.token_id for o in got] == [o.token_id for o in ref]
        assert_close(mode, torch.tensor([v for _, v in ref[0].top_logprobs]), torch.tensor([v for _, v in got[0].top_logprobs]))
    assert got[0].stats.prefill_steps >= 1


def test_running_streams_keep_decoding_during_a_long_cold_prefill(engine):
    """Budget 32 tokens per step: a 300-token cold request prefills over >= 9 steps, and the running
    stream produces a token in every one of them."""
    eng = engines.engine(3, like=engine, max_step_tokens=32)
    vocab = len(engine.tokenizer)
    running = eng.add_request(GenerationRequest(random_segments((10, 5), vocab=vocab, seed=1),
                                                sampling=SamplingParams(max_tokens=40, ignore_eos=True)))
    eng.step()
    cold = eng.add_request(GenerationRequest(random_segments((100, 120, 80, 6), vocab=vocab, seed=2),
                                             sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
    prefill_steps = 0
    while cold.num_generated == 0:
        produced = {o.request_id for o in eng.step()}
        prefill_steps += 1
        assert running.request_id in produced
    assert prefill_steps >= 9 and cold.stats.prefill_steps == prefill_steps


def test_cold_segment_shared_by_two_requests_is_computed_once(engine, monkeypatch):
    eng = engines.engine(3, like=engine)
    vocab = len(engine.tokenizer)
    shared, a, b, q = random_segments((40, 20, 25, 5), vocab=vocab, seed=8)
    computed = []
    original = eng.runner.compute_entries
    monkeypatch.setattr(eng.runner, "compute_entries", lambda segs, *args: computed.extend(segs) or original(segs, *args))
    sampling = SamplingParams(max_tokens=2)
    eng.add_request(GenerationRequest((shared, a, q), sampling=sampling))
    eng.add_request(GenerationRequest((b, shared, q), sampling=sampling))
    while eng.has_unfinished():
        eng.step()
    assert sorted(map(len, computed)) == [20, 25, 40]


def test_memory_budget_bounds_the_running_set(engine):
    vocab = len(engine.tokenizer)
    req = GenerationRequest(random_segments((30, 5), vocab=vocab, seed=3), sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    probe = engines.engine(3, like=engine)
    need = probe.add_request(req).reserved_bytes
    eng = engines.engine(3, like=engine, running_budget_bytes=int(need * 1.5))
    seqs = [eng.add_request(req) for _ in range(3)]
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, eng.scheduler.num_active)
    assert most == 1 and all(s.num_generated == 6 for s in seqs)
    huge = GenerationRequest(req.segments, sampling=SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(huge)
    assert err.value.field == "max_tokens"


def test_one_forward_per_sequence_fallback_matches_the_batch(engine):
    """A family that cannot take the batched layout decodes each sequence on its own cache: same outputs."""
    reqs = requests(engine)
    batched = run_together(engines.engine(like=engine), reqs)
    alone = engines.engine(like=engine)
    alone.adapter.supports_batched_decode = False  # this engine's adapter instance only
    serial = run_together(alone, reqs)
    assert len(alone.runner.batch) == 0
    for i in batched:
        assert [o.token_id for o in serial[i]] == [o.token_id for o in batched[i]]


def test_decode_steps_joins_and_leaves_keep_the_buffers_in_place():
    """With room reserved, steps write K/V and linear states in place, a join copies only its own row
    in and a leave moves one row: no buffer is reallocated or re-concatenated, the cache object stays
    (and the logits still match, test_batched_decode_equals_one_at_a_time)."""
    engine = engines.engine(3)
    batch = engine.runner.batch
    seqs = prefilled(engine)
    with torch.inference_mode():
        batch.sync([0, 1, 2], {i: seqs[i][0] for i in range(3)})
        batch.reserve(8, 256)
        ptrs, cache, room = [t.data_ptr() for t in batch.buffers()], batch.cache, batch.capacity
        pos = {i: seqs[i][1] for i in range(6)}
        for step in range(4):
            if step == 1:
                batch.sync([0, 1, 2, 3, 4], {i: seqs[i][0] for i in (3, 4)})
            if step == 2:
                batch.sync([0, 2, 3, 4], {})
            batch.forward([1] * len(batch), [pos[k] for k in batch.keys])
            for k in batch.keys:
                pos[k] += 1
        assert [t.data_ptr() for t in batch.buffers()] == ptrs and batch.capacity == room and batch.cache is cache
        assert sorted(batch.keys) == [0, 2, 3, 4] and batch.lengths == [pos[k] for k in batch.keys]
        batch.sync([], {})
        assert batch.capacity == (0, 0) and batch.cache is None  # nothing running: nothing held


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "minimax"])
def test_long_decode_grows_the_buffers_and_matches(family):
    """Past the first column capacity (growth mid-run), with a join and leaves on the way, and for a
    family whose cache replaces its linear state each step (minimax: the new tensor is adopted),
    every step's logits match the plain path."""
    engine = engines.engine(3, family)
    runner = engine.runner
    seqs = prefilled(engine)
    ref_caches = [copy.deepcopy(c) for c, _, _ in seqs]
    pos = [p for _, p, _ in seqs]
    tokens = [int(lg.argmax()) for _, _, lg in seqs]
    members, grew = [0, 1, 2], set()
    with torch.inference_mode():
        for step in range(90):
            if step == 30:
                members += [3, 4]
            if step == 50:
                members.remove(0)
            if step == 70:
                members.remove(4)  # the last row
            runner.batch.sync(members, {i: seqs[i][0] for i in members})
            grew.add(runner.batch.capacity[1])
            rows = runner.batch.forward([tokens[i] for i in runner.batch.keys], [pos[i] for i in runner.batch.keys])
            for i, lg in zip(runner.batch.keys, rows):
                ref = runner.forward([tokens[i]], pos[i], ref_caches[i], logits=True)
                assert_close(f"{family} seq {i} step {step}", ref, lg)
                tokens[i], pos[i] = int(ref.argmax()), pos[i] + 1
    assert len(grew) > 1  # the columns grew while rows were decoding
