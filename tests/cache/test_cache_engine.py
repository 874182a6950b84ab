"""End to end: an Engine on a tiered store answers identically cold, warm from memory, warm from disk
in a new Engine, and with a damaged disk entry (recomputed); a failing disk never changes an answer."""

from __future__ import annotations

import sqlite3

import diskcache
import pytest
import torch

from helpers import random_segments
from hypic_core.algebra.keys import SegmentKey, model_fingerprint
from hypic_core.cache import TieredSegmentStore, build_store
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.testing import tiny_model

LENGTHS = (12, 30, 21, 5)  # system prompt, two chunks, question
CONFIG = EngineConfig(seam=4)


@pytest.fixture(scope="module")
def request_():
    return GenerationRequest(random_segments(LENGTHS, seed=5), sampling=SamplingParams(max_tokens=4))


def answer(engine: Engine, request: GenerationRequest):
    """First-token logits and the greedy continuation (one prefill)."""
    prefilled = engine.prefill(request)
    return prefilled.logits, [e.token_id for e in engine.generate(request, prefilled=prefilled)]


def fresh_engine(model, directory, **kw) -> tuple[Engine, TieredSegmentStore]:
    store = build_store(1 << 26, directory=directory, disk_min_tokens=0, **kw)
    return Engine(model, config=CONFIG, store=store), store


def test_cold_warm_memory_warm_disk_and_corrupted_answer_identically(model, request_, tmp_path):
    d = tmp_path / "cache"
    n = len(LENGTHS) - 1
    engine, store = fresh_engine(model, d)
    cold_logits, cold_tokens = answer(engine, request_)
    store.flush()
    with diskcache.Cache(str(d)) as raw:
        assert store.stats().misses == n and len(raw) == n

    warm_logits, warm_tokens = answer(engine, request_)
    assert store.stats().hits["host"] >= n
    assert torch.equal(warm_logits, cold_logits) and warm_tokens == cold_tokens

    restarted, store2 = fresh_engine(model, d)  # new process: empty memory tiers, same directory
    disk_logits, disk_tokens = answer(restarted, request_)
    assert store2.stats().hits["disk"] == n and store2.stats().corrupt == 0
    assert torch.equal(disk_logits, cold_logits) and disk_tokens == cold_tokens

    with diskcache.Cache(str(d)) as raw:  # bit rot in one stored value
        victim = sorted(raw)[1]
        data = bytearray(raw[victim])
        data[len(data) // 2] ^= 0xFF
        raw[victim] = bytes(data)
    damaged, store3 = fresh_engine(model, d)
    bad_logits, bad_tokens = answer(damaged, request_)
    s = store3.stats()
    assert s.corrupt == 1 and s.hits["disk"] == n - 1 and s.misses == 1
    # The damaged segment is recomputed alone, the cold run computed all misses as one padded
    # batch: same entry up to float rounding, so same tokens and logits within 1e-5.
    assert (bad_logits - cold_logits).abs().max().item() <= 1e-5 and bad_tokens == cold_tokens
    store3.flush()
    healed, store4 = fresh_engine(model, d)  # the recomputed entry replaced the damaged one
    answer(healed, request_)
    assert store4.stats().hits["disk"] == n and store4.stats().corrupt == 0


def test_failing_disk_never_changes_an_answer(model, request_, tmp_path, monkeypatch):
    reference = answer(Engine(model, config=CONFIG), request_)

    def broken(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "add", broken)
    monkeypatch.setattr(diskcache.Cache, "get", broken)
    engine, store = fresh_engine(model, tmp_path / "cache")
    for _ in range(2):
        logits, tokens = answer(engine, request_)
        assert torch.equal(logits, reference[0]) and tokens == reference[1]
    store.flush()
    restarted, store2 = fresh_engine(model, tmp_path / "cache")
    logits, tokens = answer(restarted, request_)
    assert torch.equal(logits, reference[0]) and tokens == reference[1]
    store2.flush()  # its failing writes run on the writer thread
    assert store.stats().dropped_writes == len(LENGTHS) - 1 and store2.stats().disk_errors > 0


def test_bf16_storage_from_disk_stays_close(model, request_, tmp_path):
    engine, store = fresh_engine(model, tmp_path / "cache", storage_dtype="bf16")
    cold = engine.prefill(request_).logits
    store.flush()
    restarted, store2 = fresh_engine(model, tmp_path / "cache", storage_dtype="bf16")
    warm = restarted.prefill(request_).logits
    assert store2.stats().hits["disk"] == len(LENGTHS) - 1
    kl = torch.sum(torch.softmax(cold, -1) * (torch.log_softmax(cold, -1) - torch.log_softmax(warm, -1))).item()
    assert not torch.equal(cold, warm) and kl < 1e-3


def test_key_covers_everything_that_changes_an_entry(model, tiny_tokenizer):
    tokens = (5, 6, 7, 8)
    base = model_fingerprint(model, "m")
    others = [model_fingerprint(model, "other-id"), model_fingerprint(model, "m", tiny_tokenizer),
              model_fingerprint(tiny_model("qwen3_5", seed=1), "m")]
    assert len({base, *others}) == 4
    half = model_fingerprint(tiny_model("qwen3_5", dtype=torch.bfloat16), "m")
    assert half != base
    key = SegmentKey.of(base, 8, tokens)
    variants = [SegmentKey.of(base, 4, tokens), SegmentKey.of(base, 8, (5, 6, 7, 9)),
                SegmentKey(key.model, key.seam, key.tokens, key.schema + 1), SegmentKey.of(others[0], 8, tokens)]
    assert len({key.to_str(), *(v.to_str() for v in variants)}) == 5
