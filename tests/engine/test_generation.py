"""Decoding: greedy/sampling, seeds, stop strings, streaming detokenization, abort, store behaviour."""

from __future__ import annotations

import threading

import pytest
import torch

import engines
from helpers import random_segments
from hypic_core.algebra.entry import SegmentEntry
from hypic_core.algebra.keys import SegmentKey
from hypic_core.cache.store import MemorySegmentStore
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, detokenizer_for
from hypic_core.engine.engine import AbortHandle
from hypic_core.engine.sampling import Sampler


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return engines.engine(4, tokenizer=tiny_tokenizer)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(engine):
    segs = random_segments((20, 30, 5), vocab=len(engine.tokenizer), seed=1)
    sampled = lambda seed: engine.generated_tokens(GenerationRequest(  # noqa: E731
        segs, sampling=SamplingParams(max_tokens=12, temperature=1.5, seed=seed)))
    assert sampled(3) == sampled(3)
    greedy = engine.generated_tokens(GenerationRequest(segs, sampling=SamplingParams(max_tokens=12)))
    assert sampled(3) != greedy or sampled(4) != greedy


def test_top_k_one_is_greedy():
    logits = torch.randn(50)
    s = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))
    assert all(s(logits).token_id == int(logits.argmax()) for _ in range(5))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {s(logits).token_id for _ in range(200)} == {0, 1}


def test_logprobs_are_reported(engine):
    segs = random_segments((10, 4), vocab=len(engine.tokenizer), seed=2)
    events = list(engine.generate(GenerationRequest(segs, sampling=SamplingParams(max_tokens=3, top_logprobs=3))))
    first = events[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 3
    assert first.top_logprobs[0][0] == first.token_id  # greedy takes the most likely token
    assert events[-1].finish_reason in ("length", "stop")


def test_max_tokens_and_finish_reason(engine):
    segs = random_segments((10, 4), vocab=len(engine.tokenizer), seed=3)
    events = list(engine.generate(GenerationRequest(segs, sampling=SamplingParams(max_tokens=5))))
    assert len(events) <= 5 and events[-1].finish_reason is not None


DETOKENIZERS = {"incremental": lambda tok, stop: IncrementalDetokenizer(tok.backend_tokenizer, stop),
                "reference": StreamDetokenizer}


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_stop_string_truncates_text(tiny_tokenizer, kind):
    ids = tiny_tokenizer.encode("The river Alna flows through Varo.", add_special_tokens=False)
    d = DETOKENIZERS[kind](tiny_tokenizer, ("flows",))
    out = ""
    for t in ids:
        out += d.push(t)
        if d.stopped:
            break
    assert d.stopped and out == "The river Alna "


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_never_emits_partial_characters(tiny_tokenizer, kind):
    text = "naïve émigrés — café"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    d = DETOKENIZERS[kind](tiny_tokenizer, ("xyz",))
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(40))
def test_incremental_detokenizer_equals_the_reference(tiny_tokenizer, seed):
    """Random token streams (special tokens, characters split over tokens, invalid UTF-8, stop strings
    that span tokens): the same text and the same stop, at the same token. (Invalid bytes may come out
    as U+FFFD a few tokens later than the reference emits them.)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(tiny_tokenizer), (60,), generator=g).tolist()
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    at = int(torch.randint(0, max(1, len(text) - 3), (1,), generator=g))
    picked = text[at:at + 3]
    stop = (picked,) if seed % 2 and picked.strip() and "\ufffd" not in picked else ("\u00e9t", "zz")
    fast, ref = IncrementalDetokenizer(tiny_tokenizer.backend_tokenizer, stop), StreamDetokenizer(tiny_tokenizer, stop)
    out_fast = out_ref = ""
    for t in ids:
        out_fast, out_ref = out_fast + fast.push(t), out_ref + ref.push(t)
        assert fast.stopped == ref.stopped
        if ref.stopped:
            break
    assert out_fast + fast.flush() == out_ref + ref.flush()
    assert isinstance(detokenizer_for(tiny_tokenizer), IncrementalDetokenizer)


def test_abort_stops_generation(engine):
    segs = random_segments((10, 4), vocab=len(engine.tokenizer), seed=4)
    handle = AbortHandle()
    events = []
    for ev in engine.generate(GenerationRequest(segs, sampling=SamplingParams(max_tokens=50)), abort=handle):
        events.append(ev)
        if len(events) == 2:
            handle.abort()
    assert events[-1].finish_reason == "abort" and len(events) == 3


def test_abort_before_prefill(engine):
    handle = AbortHandle()
    handle.abort()
    segs = random_segments((10, 10, 4), vocab=len(engine.tokenizer), seed=5)
    events = list(engine.generate(GenerationRequest(segs), abort=handle))
    assert [e.finish_reason for e in events] == ["abort"]


def test_concurrent_requests_interleave(engine):
    segs = random_segments((10, 12, 4), vocab=len(engine.tokenizer), seed=6)
    req = GenerationRequest(segs, sampling=SamplingParams(max_tokens=6))
    expected = engine.generated_tokens(req)
    results = [None, None]

    def run(i):
        results[i] = engine.generated_tokens(req)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == [expected, expected]


def _entry(n, seam=1):
    return SegmentEntry(tuple(range(n)), seam, (torch.zeros(2, n - seam, 4),), (torch.zeros(2, n - seam, 4),), (), ())


def test_memory_store_is_lru_under_byte_budget():
    e = _entry(9)
    store = MemorySegmentStore(budget_bytes=2 * e.nbytes)
    keys = [SegmentKey("m", 1, str(i)) for i in range(3)]
    store.insert(keys[0], e)
    store.insert(keys[1], e)
    assert store.lookup(keys[0], e.token_ids) is e  # touch 0: 1 is now least recent
    store.insert(keys[2], e)
    assert keys[1] not in store and keys[0] in store and keys[2] in store
    assert store.stats().evictions == 1
    store.evict(keys[1])  # evicting a missing key is a no-op


def test_memory_store_verifies_token_ids():
    store = MemorySegmentStore(1 << 20)
    key = SegmentKey("m", 1, "h")
    store.insert(key, _entry(5))
    assert store.lookup(key, (9, 9, 9, 9, 9)) is None  # a hash hit with other tokens is a miss
    assert store.stats().corrupt == 1 and key not in store


def test_entry_roundtrips_through_flat_tensors():
    engine = engines.engine(3)
    (seg,) = random_segments((20,), seed=9)
    entries, _ = engine.segment_entries((seg,), 3)
    back = SegmentEntry.from_tensors(entries[0].to_tensors())
    assert back.token_ids == entries[0].token_ids and back.seam == 3
    assert all(torch.equal(a, b) for a, b in zip(back.keys, entries[0].keys))
    assert all(torch.equal(a.transition, b.transition) for a, b in zip(back.operators, entries[0].operators))
