"""A request's `cache_salt` is in every key it builds (entries, exact snapshots, their sightings), so
nothing one salt computed serves another; `cache_store=False` computes and answers but keeps nothing."""

from __future__ import annotations

import pytest
import torch

from helpers import random_segments
from hypic_core.algebra.keys import SegmentKey
from hypic_core.cache.store import MemorySegmentStore
from hypic_core.config import EngineConfig, GenerationRequest, Mode, SamplingParams
from hypic_core.engine.engine import Engine

LENGTHS = (12, 30, 21, 5)  # system prompt, two chunks, question


class CountingStore(MemorySegmentStore):
    """A memory store that counts inserts (every tier's write goes through `insert`)."""

    def __init__(self) -> None:
        super().__init__(1 << 26)
        self.inserts = 0

    def insert(self, key, entry) -> None:
        self.inserts += 1
        super().insert(key, entry)


def engine(model, **config) -> Engine:
    return Engine(model, config=EngineConfig(seam=4, **config), store=CountingStore())


def request(salt: str = "", store: bool = True, mode: Mode = Mode.HYPIC, exact_prefix: int = 1) -> GenerationRequest:
    return GenerationRequest(random_segments(LENGTHS, seed=5), mode, sampling=SamplingParams(max_tokens=1),
                             exact_prefix=exact_prefix, cache_salt=salt, cache_store=store)


def test_key_strings_differ_by_salt_and_never_name_it():
    tokens = (5, 6, 7)
    plain, a, b = (SegmentKey.of("f" * 64, 4, tokens, salt) for salt in ("", "tenant:alice", "tenant:bob"))
    assert len({plain.to_str(), a.to_str(), b.to_str()}) == 3
    assert plain.to_str() == SegmentKey.of("f" * 64, 4, tokens).to_str()  # the unsalted key of before
    assert "alice" not in a.to_str()


def test_entries_and_snapshots_of_one_salt_never_serve_another(model):
    eng = engine(model, exact_repeats=True)
    first = eng.prefill(request("tenant:a")).stats
    assert first.segment_hits == 0
    again = eng.prefill(request("tenant:a")).stats
    assert again.segment_hits > 0 and (again.exact_tokens + again.composed_tokens) > 0
    other = eng.prefill(request("tenant:b")).stats  # same tokens, another tenant: everything computed afresh
    assert other.segment_hits == 0 and other.exact_tokens == 0 and other.composed_tokens == 0
    unsalted = eng.prefill(request("")).stats
    assert unsalted.segment_hits == 0 and unsalted.exact_tokens == 0 and unsalted.composed_tokens == 0


def test_prefix_snapshots_are_salted(model):
    eng = engine(model)
    eng.prefill(request("tenant:a", mode=Mode.PREFIX))
    assert eng.prefill(request("tenant:a", mode=Mode.PREFIX)).stats.exact_tokens > 0
    assert eng.prefill(request("tenant:b", mode=Mode.PREFIX)).stats.exact_tokens == 0


@pytest.mark.parametrize("cold_prefill", ["stitch", "exact"])
def test_store_false_keeps_no_entry_snapshot_or_sighting(model, cold_prefill):
    eng = engine(model, exact_repeats=True, cold_prefill=cold_prefill)
    kept_nothing = request("tenant:a", store=False)
    logits = eng.prefill(kept_nothing).logits
    for _ in range(2):  # a repeat would be snapshotted at its second sighting
        list(eng.generate(kept_nothing))
    for _ in range(3):  # steps in which background (deferred) work would run
        eng.step()
    assert eng.store.inserts == 0 and len(eng.store) == 0
    assert len(eng.exact_runs._index) == 0 and len(eng.exact_runs._seen) == 0
    assert len(eng.cache_manager.background) == 0
    # It still answers as a request that stores does, and what it computed was not kept for anyone.
    stored = eng.prefill(request("tenant:a"))
    assert stored.stats.segment_hits == 0
    assert torch.allclose(stored.logits, logits, atol=1e-5)
    list(eng.generate(request("tenant:a")))
    for _ in range(3):
        eng.step()
    assert eng.store.inserts > 0


def test_store_false_reads_what_is_cached(model):
    eng = engine(model)
    eng.prefill(request("tenant:a"))
    inserts = eng.store.inserts
    stats = eng.prefill(request("tenant:a", store=False)).stats
    assert stats.segment_hits > 0 and eng.store.inserts == inserts


def test_request_fields_are_checked():
    from hypic_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="cache_salt"):
        GenerationRequest(((1,), (2,)), cache_salt=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="cache_store"):
        GenerationRequest(((1,), (2,)), cache_store=1)  # type: ignore[arg-type]
