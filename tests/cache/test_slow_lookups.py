"""A slow or stopped shared tier costs the new request, never HTTP or the other streams.

A stitched request's segment lookups may read the disk or wait on Redis (up to its timeout). The
memory tiers are asked as it arrives; the stored tiers on the engine's lookup threads
(hypic_core/engine/lookups.py), in parallel, never on the HTTP event loop or the engine thread, and
the request waits for them at most its deadline (`EngineConfig.lookup_deadline_s`, 1 s here): what
has not returned by then is computed, the same canonical bytes, so the answer does not change, and
a lookup that returns later leaves its entry in memory for the next request. So `/health` answers at
once, a warm request arriving behind slow lookups streams at once, running streams never pause,
and the slow request itself waits about its deadline, not the tier's timeout. Against a real
redis-server: behind a proxy that holds every reply (0.4 s, 2 s), and stopped with SIGSTOP under a
5 s timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from app.service.settings import Settings
from app.testing import LiveServer, free_port, single_torch_thread

import stores

CORPUS = [
    {"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
    {"id": "firm-brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."},
    {"id": "river-alna", "title": "Alna", "text": "The Alna is a river that flows into the sea near Varo."},
    {"id": "lake-oro", "title": "Oro", "text": "Lake Oro lies north of Brill's first factory, beside the old mill."},
    {"id": "mill-oro", "title": "Oro mill", "text": "The old mill by Lake Oro ground grain for Varo until 1950."},
    {"id": "kell", "title": "Ines Kell", "text": "Ines Kell was born in Alna Bay and studied law before politics."},
    {"id": "oke", "title": "Tam Oke", "text": "Tam Oke sold Brill in 2015 and moved to a farm near the river."},
    {"id": "bay", "title": "Alna Bay", "text": "Alna Bay is where the river Alna meets the sea, south of Varo."},
]
WARM = {"question": "Who is the mayor of Varo?", "top_k": 2, "max_tokens": 24, "mode": "hypic"}
COLD = {"question": "Which lake lies beside the old mill?", "top_k": 8, "max_tokens": 4, "mode": "hypic"}
COLD2 = {**COLD, "question": "Who ground grain for Varo?"}  # the same eight chunks: both wait on the same lookups
STREAM_BOUND_S = 2.0  # a warm stream's first token and every gap after it, on a loaded 2-core machine (before: 3.1-5.7 s)


class DelayingProxy:
    """A TCP proxy in front of a real server that holds each reply `delay` seconds."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.delay = 0.0
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while data := src.recv(65536):
                if reply and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def gateway(root, tokenizer, redis_url: str, timeout_s: float):
    return stores.gateway(root, tokenizer, CORPUS, redis_url=redis_url, redis_timeout_s=timeout_s, **_secret())


def _secret() -> dict:
    """The deployment secret a shared tier needs, where the settings have one."""
    return {"cache_secret": "test-secret"} if "cache_secret" in Settings.model_fields else {}


class HealthProbe:
    """Polls GET /health every 50 ms in its own thread and keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                assert client.get(f"{self.url}/health").status_code == 200
                self.worst, self.count = max(self.worst, time.perf_counter() - t), self.count + 1
                self._stop.wait(0.05)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def stream_events(g, body: dict) -> tuple[list[float], float]:
    """Stream `body` from /query: (arrival time of each SSE event, when the request was sent)."""
    sent, times = time.perf_counter(), []
    with httpx.stream("POST", f"{g.url}/query", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
    return times, sent


def run_beside_slow_lookups(g) -> tuple[float, float, float]:
    """Send COLD and COLD2 (their eight chunks miss memory, so they wait on Redis; with lookups on two
    threads as before, both threads are then busy), then stream WARM (its entries are in memory).
    Returns (WARM's first token after it was sent, the longest gap between its events, the cold
    requests' longest whole time)."""
    ends: dict[str, float] = {}

    def cold(body: dict) -> None:
        t = time.perf_counter()
        r = httpx.post(f"{g.url}/query", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ends[body["question"]] = time.perf_counter() - t

    threads = [threading.Thread(target=cold, args=(b,)) for b in (COLD, COLD2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # both are in their lookups
    times, sent = stream_events(g, WARM)
    for t in threads:
        t.join(timeout=60)
    assert len(times) > 3 and len(ends) == 2
    gaps = [b - a for a, b in zip(times, times[1:])]  # from the `sources` event on: the first token's wait included
    return times[1] - sent, max(gaps), max(ends.values())


@pytest.fixture
def redis(redis_server):
    redis_server.client().flushall()
    return redis_server


def test_a_redis_answering_in_400ms_costs_neither_http_nor_a_warm_stream(redis, tiny_tokenizer, tmp_path):
    proxy = DelayingProxy(redis.port)
    app, store = gateway(tmp_path / "g", tiny_tokenizer, proxy.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app) as g:
            g.wait_ready()
            assert httpx.post(f"{g.url}/query", json=WARM, timeout=60).status_code == 200  # WARM's entries in memory
            proxy.delay = 0.4
            with HealthProbe(g.url) as health:
                first, gap, cold = run_beside_slow_lookups(g)
    finally:
        proxy.delay = 0.0
        store.close()
        proxy.close()
    # Lookups one after another on two threads: WARM waited ~3.2 s (eight lookups of 0.4 s) before its first token.
    assert first < STREAM_BOUND_S and gap < STREAM_BOUND_S, (first, gap, cold)
    assert cold < 3.0, cold  # eight 0.4 s lookups in parallel (or the deadline), not one after another
    assert health.count >= 5 and health.worst < 0.2, (health.worst, first, gap, cold)


def test_a_stopped_redis_costs_the_new_request_its_deadline_not_the_timeout(redis, tiny_tokenizer, tmp_path):
    app, store = gateway(tmp_path / "g", tiny_tokenizer, redis.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app) as g:
            g.wait_ready()
            assert httpx.post(f"{g.url}/query", json=WARM, timeout=60).status_code == 200
            os.kill(redis.process.pid, signal.SIGSTOP)
            try:
                with HealthProbe(g.url) as health:
                    first, gap, cold = run_beside_slow_lookups(g)
            finally:
                os.kill(redis.process.pid, signal.SIGCONT)
            metrics = httpx.get(f"{g.url}/metrics", timeout=30).text
    finally:
        store.close()
    # Before: WARM waited ~5 s for a lookup thread, and each cold request out the 5 s timeout.
    assert first < STREAM_BOUND_S and gap < STREAM_BOUND_S, (first, gap, cold)
    assert cold < 4.0, cold  # its 1 s deadline and its own prefill, well under the 5 s timeout
    late = [line for line in metrics.splitlines() if line.startswith("hypic_cache_lookup_late_requests_total")]
    assert late and float(late[0].rsplit(" ", 1)[1]) >= 2, late  # both cold requests went on without Redis
    assert health.count >= 10 and health.worst < 0.2, (health.worst, first, gap, cold)


def test_an_entry_that_arrives_after_its_deadline_serves_the_next_request_and_answers_do_not_change(
        redis, tiny_tokenizer, tmp_path):
    """g0 computes COLD's entries into Redis; g1 (memory empty) reaches Redis through a proxy holding each
    reply 2 s, past its 1 s deadline: its COLD is computed cold (keeping nothing itself), the lookups land
    their entries in g1's memory afterwards, and the next COLD composes them. All three answers agree."""
    app0, store0 = gateway(tmp_path / "g0", tiny_tokenizer, redis.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app0) as g0:
            g0.wait_ready()
            r0 = httpx.post(f"{g0.url}/query", json=COLD, timeout=60).json()
            store0.flush()
    finally:
        store0.close()
    proxy = DelayingProxy(redis.port)
    app1, store1 = gateway(tmp_path / "g1", tiny_tokenizer, proxy.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app1) as g1:
            g1.wait_ready()
            before = store1.stats().hits["redis"]
            proxy.delay = 2.0
            r1 = httpx.post(f"{g1.url}/query", json={**COLD, "cache": {"store": False}}, timeout=60).json()
            deadline = time.monotonic() + 30
            while store1.stats().hits["redis"] < before + 8 and time.monotonic() < deadline:
                time.sleep(0.1)  # the late lookups return
            proxy.delay = 0.0
            late = store1.stats().hits["redis"] - before
            r2 = httpx.post(f"{g1.url}/query", json=COLD, timeout=60).json()
            assert store1.stats().hits["redis"] - before == late  # served from memory, not asked again
    finally:
        store1.close()
        proxy.close()
    assert late == 8, late
    assert r1["usage"]["composed_tokens"] == 0 and r2["usage"]["composed_tokens"] > 0, (r1["usage"], r2["usage"])
    assert r0["answer"] == r1["answer"] == r2["answer"]
