"""Parallel cold prefill (hypic_core/prefill_pool): entries computed by worker processes or Ray actors
are the same bytes as the engine's own, generation is unchanged, and a worker killed mid-request
costs nothing but time. Real processes, a real local Ray instance, the bundled model."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import engines
from hypic_core.cache.store import MemorySegmentStore
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.prefill_pool import PrefillPool, ReplicaSpec
from hypic_core.prefill_pool.backends import Event
from hypic_core.prefill_pool.split import join_pieces, split_points

MODEL_DIR = str(Path(__file__).resolve().parents[2] / "models" / "hypic-tiny")
SEAM = 8


def segments(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(5, 400, (n,), generator=g).tolist()) for n in lengths]


def tensor_bytes(entry) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of an entry as (dtype, shape, raw bytes). The serialized form itself is not
    compared whole: safetensors writes its metadata map in no fixed order."""
    return {name: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for name, t in entry.to_tensors().items()}


def local_entry(engine: Engine, segment):
    with torch.inference_mode():
        return engine.runner.compute_entries([segment], SEAM, engine.config.max_cold_batch_tokens)[0]


def request(chunks, question, max_tokens=6):
    return GenerationRequest((*chunks, question), seam=SEAM, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def plain():
    return Engine.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def pool():
    pool = PrefillPool(ReplicaSpec(MODEL_DIR, threads=1), workers=2)
    assert pool.wait_ready(180) == 2
    yield pool
    pool.close()


def pooled_engine(plain: Engine, pool: PrefillPool) -> Engine:
    """An engine on the same model as `plain`, an empty store, computing cold entries on `pool`."""
    return engines.engine(like=plain, store=MemorySegmentStore(1 << 30), prefill_pool=pool)


def test_pool_entries_are_the_local_bytes(plain, pool):
    segs = segments([300, 7, 120, 64, 1, 200])  # shorter than the seam and one token too
    engine = pooled_engine(plain, pool)
    before = pool.stats["remote"]
    got = pool.compute_entries(segs, SEAM)
    assert pool.stats["remote"] - before == len(segs)  # all of them came from the workers
    for seg, entry in zip(segs, got):
        assert entry.token_ids == seg
        assert tensor_bytes(entry) == tensor_bytes(local_entry(plain, seg)), f"segment of {len(seg)} tokens"
    assert engine.pool is pool


def test_generation_with_the_pool_equals_without(plain, pool):
    chunks, question = segments([350, 90, 260, 180, 40], seed=1), segments([12], seed=2)[0]
    expected = engines.engine(like=plain, store=MemorySegmentStore(1 << 30)).generated_tokens(request(chunks, question))
    engine = pooled_engine(plain, pool)
    before = pool.stats["remote"]
    assert engine.generated_tokens(request(chunks, question)) == expected
    assert pool.stats["remote"] - before == len(chunks)
    assert engine.generated_tokens(request(chunks[::-1], question)) != []  # warm now: no pool work
    assert pool.stats["remote"] - before == len(chunks)
    stored = engine.segment_entries(tuple(chunks), SEAM)
    assert all(stored.hits)


def test_two_requests_in_one_step_share_the_pool(plain, pool):
    """Requests admitted in the same step hand their cold segments over together; a segment both
    need is computed once; both generate what they generate alone."""
    a, b, shared = segments([220, 150], seed=3), segments([300, 60], seed=4), segments([180], seed=5)[0]
    q = segments([10], seed=6)[0]
    reference = engines.engine(like=plain, store=MemorySegmentStore(1 << 30))
    want = [reference.generated_tokens(request([*a, shared], q)), reference.generated_tokens(request([shared, *b], q))]
    engine = pooled_engine(plain, pool)
    seqs = [engine.add_request(request([*a, shared], q), collect=True), engine.add_request(request([shared, *b], q), collect=True)]
    before = pool.stats["remote"]
    while engine.has_unfinished():
        engine.step()
    got = [[o.token_id for o in s.outbox if o.token_id is not None] for s in seqs]
    assert got == want
    assert pool.stats["remote"] - before == 5


def test_worker_killed_mid_request(plain, pool):
    """kill -9 of a worker computing a segment: the segment is computed again elsewhere, the request
    completes with the right tokens, and the pool starts a replacement."""
    chunks, question = segments([500, 450, 400, 350], seed=7), segments([9], seed=8)[0]
    expected = engines.engine(like=plain, store=MemorySegmentStore(1 << 30)).generated_tokens(request(chunks, question))
    engine = pooled_engine(plain, pool)
    deaths, requeued = pool.stats["deaths"], pool.stats["requeued"]
    result: list = []
    runner = threading.Thread(target=lambda: result.append(engine.generated_tokens(request(chunks, question))))
    runner.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and time.monotonic() < deadline and runner.is_alive():
        busy = pool.pids(busy_only=True)
        if busy:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.001)
    runner.join(120)
    assert killed is not None, "no worker was ever busy"
    assert result == [expected]
    assert pool.stats["deaths"] == deaths + 1 and pool.stats["requeued"] == requeued + 1
    assert pool.wait_ready(180) == 2 and killed not in pool.pids()  # replaced


def test_no_worker_left_computes_locally(plain):
    """With its only worker killed and no restarts left, the engine computes every segment itself."""
    segs = segments([260, 30, 140], seed=9)
    with PrefillPool(ReplicaSpec(MODEL_DIR, threads=1), workers=1, max_restarts=0) as pool:
        pooled_engine(plain, pool)
        assert pool.wait_ready(180) == 1
        tickets = pool.submit([(s, SEAM) for s in segs])  # the longest is on the worker now
        os.kill(pool.pids(busy_only=True)[0], signal.SIGKILL)
        got = pool.collect(tickets)
        assert pool.alive == 0 and pool.stats["local"] == len(segs) and pool.stats["requeued"] == 1
    for seg, entry in zip(segs, got):
        assert tensor_bytes(entry) == tensor_bytes(local_entry(plain, seg))


def test_bad_bytes_from_a_worker_are_a_local_recompute(plain, pool):
    """A worker's answer that does not decode (checksum, key, tokens) is never used."""
    seg = segments([90], seed=10)[0]
    pooled_engine(plain, pool)
    good = pool.compute_entries([seg], SEAM)[0]
    corrupt = pool.stats["corrupt"]
    (ticket,) = pool.submit([(seg, SEAM)])
    busy = pool.workers(busy_only=True)[0]
    pool._handle([Event("done", busy, ticket, b"HYPICSEG" + b"\0" * 64)])  # as if the worker had sent it
    entry = pool.take(ticket)
    assert pool.stats["corrupt"] == corrupt + 1
    assert entry is not None and tensor_bytes(entry) == tensor_bytes(good)
    time.sleep(0.5)
    pool.poll()  # the worker's real answer arrives for a ticket already taken: dropped
    assert pool.take(ticket) is None


def test_split_points_cover_the_segment():
    for length, piece in ((300, 128), (128, 128), (129, 128), (4096, 512), (70, 64), (1000, 333)):
        pts = split_points(length, piece)
        assert pts[0][0] == 0 and pts[-1][1] == length and all(a[1] == b[0] for a, b in zip(pts, pts[1:]))
        sizes = [b - a for a, b in pts]
        assert max(sizes) <= piece and max(sizes) - min(sizes) <= 1 and len(pts) == -(-length // piece)
    with pytest.raises(ValueError, match="64"):
        split_points(100, 32)


def test_joined_pieces_equal_stitching_the_pieces(plain):
    """A joined entry is exactly the pieces stitched as consecutive segments (seam 0 after the first)."""
    seg, question = segments([300], seed=13)[0], segments([12], seed=14)[0]
    runner = plain.runner
    pieces = [seg[a:b] for a, b in split_points(len(seg), 128)]
    with torch.inference_mode():
        entries = [runner.compute_entries([p], SEAM if i == 0 else 0, 512)[0] for i, p in enumerate(pieces)]
        joined = join_pieces(entries, runner.adapter)
        one = runner.stitch(runner.new_cache(), [seg], [joined], question)
        several = runner.stitch_sequential(runner.new_cache(), pieces, entries, question)
        unsplit = runner.stitch(runner.new_cache(), [seg], [local_entry(plain, seg)], question)
    assert joined.token_ids == seg and joined.seam == SEAM and joined.keys[0].shape[-2] == len(seg) - SEAM
    torch.testing.assert_close(one, several, rtol=1e-4, atol=1e-4)
    assert (one - unsplit).abs().max() > 1e-3  # an approximation: attention in a piece misses the earlier pieces


def test_a_split_pool_joins_the_workers_pieces(plain, pool):
    seg, question = segments([300], seed=15)[0], segments([10], seed=16)[0]
    pool.split_tokens = 128
    try:
        engine = pooled_engine(plain, pool)
        assert engine.fingerprint != plain.fingerprint  # split entries never under the canonical keys
        before = pool.stats["remote"]
        (entry,) = engine.segment_entries((seg,), SEAM).entries
        assert pool.stats["remote"] - before == 3  # three pieces, on the workers
        with torch.inference_mode():
            pieces = [plain.runner.compute_entries([seg[a:b]], SEAM if i == 0 else 0, 512)[0]
                      for i, (a, b) in enumerate(split_points(len(seg), 128))]
        assert tensor_bytes(entry) == tensor_bytes(join_pieces(pieces, plain.runner.adapter))
        assert len(engine.generated_tokens(request([seg], question, max_tokens=3))) == 3
    finally:
        pool.split_tokens = 0


def test_a_replica_with_other_weights_is_never_used(plain, pool):
    """(Runs last on the shared pool: it leaves it one worker.)"""
    pooled_engine(plain, pool)
    pool.wait_ready(180)
    assert len(pool.workers()) == 2
    pool._handle([Event("ready", 1, None, "a digest of other weights")])  # as if worker 1 had loaded another model
    assert pool.workers() == [0] and pool.alive == 1
    seg = segments([150], seed=12)[0]
    before = pool.stats["remote"]
    assert tensor_bytes(pool.compute_entries([seg], SEAM)[0]) == tensor_bytes(local_entry(plain, seg))
    assert pool.stats["remote"] == before + 1  # computed by worker 0


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ReplicaSpec(str(tmp_path))
    with pytest.raises(ValueError, match="threads"):
        ReplicaSpec(MODEL_DIR, threads=0)
    with pytest.raises(ValueError, match="backend"):
        PrefillPool(ReplicaSpec(MODEL_DIR), workers=1, backend="threads")
    with pytest.raises(ValueError, match="worker"):
        PrefillPool(ReplicaSpec(MODEL_DIR), workers=0)


def test_ray_actors_compute_the_same_bytes_and_survive_a_kill(plain):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})
    try:
        with PrefillPool(ReplicaSpec(MODEL_DIR, threads=1), workers=2, backend="ray") as pool:
            pooled_engine(plain, pool)
            assert pool.wait_ready(600) == 2  # ~20 s on an idle 2-core machine; minutes on a loaded one
            segs = segments([400, 380, 120, 60], seed=11)
            tickets = pool.submit([(s, SEAM) for s in segs])
            ray.kill(pool._backend.actor(pool.workers(busy_only=True)[0]))
            got = pool.collect(tickets)
            assert pool.stats["deaths"] == 1 and pool.stats["requeued"] == 1 and pool.stats["remote"] == len(segs)
        for seg, entry in zip(segs, got):
            assert tensor_bytes(entry) == tensor_bytes(local_entry(plain, seg))
    finally:
        ray.shutdown()


def test_settings_name_the_pool(monkeypatch):
    from pydantic import ValidationError

    from app.service.settings import Settings

    assert (Settings().prefill_workers, Settings().prefill_backend) == (0, "processes")  # off by default
    monkeypatch.setenv("HYPIC_PREFILL_WORKERS", "2")
    monkeypatch.setenv("HYPIC_PREFILL_BACKEND", "ray")
    settings = Settings()
    assert (settings.prefill_workers, settings.prefill_backend, settings.prefill_worker_threads) == (2, "ray", None)
    for name, bad in (("HYPIC_PREFILL_WORKERS", "-1"), ("HYPIC_PREFILL_BACKEND", "threads"), ("HYPIC_PREFILL_WORKER_THREADS", "0")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValidationError, match=name.removeprefix("HYPIC_").lower()):
            Settings()
        monkeypatch.delenv(name)
