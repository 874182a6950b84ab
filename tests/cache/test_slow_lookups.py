"""A slow or stopped shared tier never stalls HTTP or the other streams.

A stitched request's segment lookups may read the disk or wait on Redis (up to its timeout).
They run on the engine's lookup threads (hypic_core/engine/lookups.py), not on the HTTP event
loop and not under the scheduler's lock, and not on the engine thread: `/health` answers at
once and requests whose lookups are done keep running. Against a real redis-server: behind a
proxy that holds every reply 0.4 s, and stopped with SIGSTOP under a 5 s timeout.
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


def run_beside_a_slow_lookup(g) -> tuple[float, float]:
    """Start COLD (at least six of its eight lookups wait on Redis), then stream WARM (its entries are in memory) while
    COLD is still looking up: WARM ends first. Returns (WARM's whole time, COLD's whole time)."""
    ends: dict[str, float] = {}

    def cold() -> None:
        r = httpx.post(f"{g.url}/query", json=COLD, timeout=60)
        assert r.status_code == 200, r.text
        ends["cold"] = time.perf_counter()

    t0 = time.perf_counter()
    thread = threading.Thread(target=cold)
    thread.start()
    time.sleep(0.1)  # COLD is in its lookups
    t1 = time.perf_counter()
    with httpx.stream("POST", f"{g.url}/query", json={**WARM, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    ends["warm"] = time.perf_counter()
    thread.join(timeout=60)
    assert len(events) > 3 and "cold" in ends
    assert ends["warm"] < ends["cold"], (ends["warm"] - t1, ends["cold"] - t0)  # it did not wait for COLD
    return ends["warm"] - t1, ends["cold"] - t0


@pytest.fixture
def redis(redis_server):
    redis_server.client().flushall()
    return redis_server


def test_a_redis_answering_in_400ms_stalls_neither_http_nor_other_streams(redis, tiny_tokenizer, tmp_path):
    proxy = DelayingProxy(redis.port)
    app, store = gateway(tmp_path / "g", tiny_tokenizer, proxy.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app) as g:
            g.wait_ready()
            assert httpx.post(f"{g.url}/query", json=WARM, timeout=60).status_code == 200  # WARM's entries in memory
            proxy.delay = 0.4
            with HealthProbe(g.url) as health:
                warm, cold = run_beside_a_slow_lookup(g)
    finally:
        proxy.delay = 0.0
        store.close()
        proxy.close()
    assert health.count >= 5 and health.worst < 0.2, (health.worst, warm, cold)


def test_a_stopped_redis_stalls_neither_http_nor_other_streams(redis, tiny_tokenizer, tmp_path):
    app, store = gateway(tmp_path / "g", tiny_tokenizer, redis.url, timeout_s=5.0)
    try:
        with single_torch_thread(), LiveServer(app) as g:
            g.wait_ready()
            assert httpx.post(f"{g.url}/query", json=WARM, timeout=60).status_code == 200
            os.kill(redis.process.pid, signal.SIGSTOP)
            try:
                with HealthProbe(g.url) as health:
                    warm, cold = run_beside_a_slow_lookup(g)
            finally:
                os.kill(redis.process.pid, signal.SIGCONT)
    finally:
        store.close()
    assert cold > 5.0  # it waited out the timeout
    assert health.count >= 20 and health.worst < 0.2, (health.worst, warm, cold)
