"""Gateway replicas on Ray Serve (app/serve_ray): the chunk directory and its policy against a
plain reference, routing keys, the ASGI bridge, and, on a real local Ray instance with two
replicas of the bundled model, affinity (same chunks -> same replica, a cache hit there), the
load bound (a saturated owner is passed over) and SSE streaming through Serve."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from app.serve_ray.asgi import ForwardedRequest, serve_asgi
from app.serve_ray.directory import ChunkDirectory, Choice, choose
from app.serve_ray.keys import chunk_key, routing_keys, text_key

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Directory and policy (no Ray)
# --------------------------------------------------------------------------------------------
def choose_reference(history: list[tuple[list[str], str]], keys: list[str], loads: dict, bound: int) -> Choice | None:
    """The policy computed from the whole routing history, nothing cached or evicted."""
    known = {r: q for r, q in loads.items() if q is not None}
    if not known:
        return None
    holders: dict[str, set] = {}
    for ks, r in history:
        for k in ks:
            holders.setdefault(k, set()).add(r)
    matched = {r: sum(1 for k in set(keys) if r in holders.get(k, ())) for r in loads}
    held = {r: sum(1 for hs in holders.values() if r in hs) for r in known}
    least = min(known.values())
    within = [r for r in known if known[r] - least <= bound]
    ranked = sorted(within, key=lambda r: (-matched[r], known[r], held[r], list(known).index(r)))
    if matched[ranked[0]] > 0:
        return Choice(ranked[0], matched[ranked[0]], "affinity")
    spread = sorted(within, key=lambda r: (known[r], held[r], list(known).index(r)))[0]
    return Choice(spread, 0, "diverted" if any(matched.values()) else "spread")


KEYS = st.lists(st.sampled_from([f"k{i}" for i in range(8)]), min_size=1, max_size=4)
REPLICAS = ["a", "b", "c"]


@given(history=st.lists(st.tuples(KEYS, st.sampled_from(REPLICAS)), max_size=12), keys=KEYS,
       loads=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=3, max_size=3), bound=st.integers(0, 3))
def test_choice_matches_reference(history, keys, loads, bound):
    directory = ChunkDirectory(max_keys=1000)
    for ks, r in history:
        directory.record(ks, r)
    load_map = dict(zip(REPLICAS, loads))
    got = choose(directory.matches(keys, REPLICAS), load_map, bound, {r: directory.held(r) for r in REPLICAS})
    assert got == choose_reference(history, keys, load_map, bound)


def test_load_bound_diverts_from_the_owner_and_spreads_new_chunks():
    directory = ChunkDirectory()
    directory.record(["x", "y"], "a")
    matched = directory.matches(["x", "y", "z"], ["a", "b"])
    assert matched == {"a": 2, "b": 0}
    assert choose(matched, {"a": 3, "b": 1}, load_bound=2) == Choice("a", 2, "affinity")
    assert choose(matched, {"a": 4, "b": 1}, load_bound=2) == Choice("b", 0, "diverted")
    assert choose(matched, {"a": None, "b": 9}, load_bound=2) == Choice("b", 0, "diverted")
    assert choose(matched, {"a": None, "b": None}, load_bound=2) is None
    # new chunks go to the replica holding fewer keys when queues are equal
    assert choose({"a": 0, "b": 0}, {"a": 0, "b": 0}, 2, {"a": 2, "b": 0}) == Choice("b", 0, "spread")
    with pytest.raises(ValueError, match="load_bound"):
        choose(matched, {"a": 0}, load_bound=-1)


def test_directory_forgets_least_recently_routed_keys_and_dead_replicas():
    directory = ChunkDirectory(max_keys=3)
    directory.record(["k1", "k2"], "a")
    directory.record(["k3"], "b")
    directory.record(["k1"], "b")  # k1 is now the most recent; k2 the oldest
    directory.record(["k4"], "a")
    assert len(directory) == 3 and directory.holders("k2") == ()
    assert directory.holders("k1") == ("a", "b") and directory.held("a") == 2 and directory.held("b") == 2
    directory.forget("b")
    assert directory.holders("k1") == ("a",) and directory.holders("k3") == () and directory.held("b") == 0
    with pytest.raises(ValueError, match="max_keys"):
        ChunkDirectory(max_keys=0)


# --------------------------------------------------------------------------------------------
# Routing keys (no Ray)
# --------------------------------------------------------------------------------------------
def fake_search(calls: list):
    def search(query, top_k, document_ids):
        calls.append((query, top_k, document_ids))
        return [f"c{i}" for i in range(top_k)]
    return search


def test_routing_keys_name_segments_and_retrieved_chunks():
    calls: list = []
    search = fake_search(calls)
    body = json.dumps({"model": "m", "prompt": "why?", "segments": ["A", "B", "A"], "rag": {"top_k": 2}}).encode()
    assert routing_keys("POST", "/v1/completions", b"", body, search) == (chunk_key("c0"), chunk_key("c1"), text_key("A"), text_key("B"))
    assert calls[-1] == ("why?", 2, None)
    chat = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "who?"}]}], "rag": {}}).encode()
    assert routing_keys("POST", "/v1/chat/completions", b"", chat, search, default_top_k=3) == tuple(chunk_key(f"c{i}") for i in range(3))
    assert calls[-1] == ("who?", 3, None)
    query = json.dumps({"question": "q", "top_k": 1, "document_ids": ["d"]}).encode()
    assert routing_keys("POST", "/query", b"", query, search) == (chunk_key("c0"),) and calls[-1] == ("q", 1, ["d"])
    assert routing_keys("GET", "/query", b"question=hi&top_k=2&document_ids=x&document_ids=y", b"", search) == (chunk_key("c0"), chunk_key("c1"))
    assert calls[-1] == ("hi", 2, ["x", "y"])


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", b"not json"), ("POST", "/v1/completions", b"[1, 2]"),
    ("POST", "/v1/completions", b'{"segments": "A"}'), ("POST", "/query", b'{"question": 3}'),
    ("POST", "/query", b'{"question": "q", "document_ids": "d"}'), ("GET", "/health", b""),
    ("POST", "/v1/completions", b"[" * 100_000), ("DELETE", "/query", b'{"question": "q"}'),
], ids=["not-json", "not-object", "segments-str", "question-int", "ids-str", "other-path", "deep", "method"])
def test_routing_keys_of_bad_or_other_requests_are_empty(method, path, body):
    assert routing_keys(method, path, b"", body, fake_search([])) == ()


def test_routing_keys_survive_a_failing_search():
    def search(*_):
        raise RuntimeError("index gone")
    assert routing_keys("POST", "/query", b"", b'{"question": "q"}', search) == ()


# --------------------------------------------------------------------------------------------
# ASGI bridge (no Ray): a real FastAPI app
# --------------------------------------------------------------------------------------------
def _streaming_app(state: dict):
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.body()).decode(), "q": request.url.query}

    @app.get("/stream")
    async def stream():
        async def parts():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                state["closed"] = True
        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


def test_serve_asgi_answers_and_streams_and_stops_when_the_consumer_does():
    state: dict = {}
    app = _streaming_app(state)

    async def main():
        request = ForwardedRequest("POST", "/echo", b"a=1", ((b"host", b"x"), (b"content-type", b"application/json")), b"hello")
        parts = [p async for p in serve_asgi(app, request, ((b"x-extra", b"1"),))]
        assert parts[0]["status"] == 200 and (b"x-extra", b"1") in parts[0]["headers"]
        assert json.loads(b"".join(p["body"] for p in parts[1:])) == {"body": "hello", "q": "a=1"}
        gen = serve_asgi(app, ForwardedRequest("GET", "/stream", headers=((b"host", b"x"),)))
        assert (await gen.__anext__())["status"] == 200
        assert (await gen.__anext__())["body"] == b"data: 0\n\n"
        await gen.aclose()  # the consumer went away
        for _ in range(100):
            if state.get("closed"):
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert state.get("closed"), "the app's stream was not stopped after the consumer left"


# --------------------------------------------------------------------------------------------
# On a real local Ray instance: two replicas of the bundled model
# --------------------------------------------------------------------------------------------
CORPUS = [{"id": f"doc{i}", "text": f"Document {i}: the river Alna{i} flows through the town of Varo{i}, whose mayor is Kell{i}. " * 4}
          for i in range(6)]


@dataclass(frozen=True)
class Served:
    url: str
    replicas: tuple[str, ...]
    redis: object  # tests/helpers.py's RedisServer


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_server):
    import ray
    from ray import serve

    from app.serve_ray.deployments import APP_NAME, build_application
    from app.service.settings import Settings
    from app.testing import free_port

    root = tmp_path_factory.mktemp("ray-serve")
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    # No disk tier: a hit shows the memory tier of the replica that served the request, or the
    # Redis tier every replica shares.
    settings = Settings(_env_file=None, index_dir=root / "index", corpus_path=root / "corpus.jsonl", embedder="hashing",
                        cache_dir=None, redis_url=redis_server.url, cache_secret="a test deployment's cache secret", guard_enabled=False,
                        torch_threads=1, ray_replicas=2, ray_replica_cpus=0,
                        ray_load_bound=1, max_running=1, max_queue=8, log_level="warning",
                        repeats="exact")  # a repeat in the same order is kept as a snapshot (the /query check below)
    # A worker process gets 5 min to start (Ray's default: 60 s), for a busy CI machine.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config={"worker_register_timeout_seconds": 300},
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()  # after ray.init: Ray binds fixed ports of its own as it starts
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        ready: set[str] = set()
        deadline = time.monotonic() + 180
        while len(ready) < 2:  # /ready lands on either replica; both must answer 200
            assert time.monotonic() < deadline, f"replicas ready: {ready}"
            response = httpx.get(f"{url}/ready", timeout=10)
            if response.status_code == 200:
                ready.add(response.headers["x-hypic-replica"])
            time.sleep(0.05)
        yield Served(url, tuple(sorted(ready)), redis_server)
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, segments: list[str], prompt: str, **extra) -> httpx.Response:
    body = {"model": "hypic-tiny", "prompt": prompt, "segments": segments, "max_tokens": 2, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=180)  # generous: 2 shared cores in CI
    assert response.status_code == 200, response.text
    return response


def _composed(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["composed_tokens"]


def _hits(url: str, replica: str) -> dict[str, float]:
    """Segment-store hits by tier of one replica (asked by name)."""
    response = httpx.get(f"{url}/metrics", headers={"X-Hypic-Replica": replica}, timeout=30)
    assert response.headers["x-hypic-replica"] == replica
    out = {}
    for line in response.text.splitlines():
        if line.startswith("hypic_cache_hits_total{"):
            tier = line.split('tier="')[1].split('"')[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


def test_same_chunks_land_on_the_same_replica_and_hit_its_cache(served):
    chunks = [f"Chunk {c}: the harbour of Brill{c} opened in 19{c}0 and its bridge is painted red. " * 3 for c in "abc"]
    first = _complete(served.url, chunks, "When did the harbour open?")
    again = _complete(served.url, chunks[::-1], "What colour is the bridge?")  # same chunks, other order and question
    assert first.headers["x-hypic-replica"] == again.headers["x-hypic-replica"]
    assert _composed(first) == 0 and _composed(again) > 0  # cold there, then reused from that replica's cache
    # chunks no replica holds go to the replica holding fewer (spread), where they are cold
    others = [f"Other {c}: the mill of Oke{c} grinds wheat every Tuesday since 18{c}5. " * 3 for c in "xyz"]
    fresh = _complete(served.url, others, "What does the mill grind?")
    assert fresh.headers["x-hypic-replica"] != first.headers["x-hypic-replica"] and _composed(fresh) == 0
    # /query: the ingress retrieves the same chunks the replica will use
    asked = [httpx.post(f"{served.url}/query", json={"question": "Which river flows through Varo3?", "max_tokens": 2}, timeout=60)
             for _ in range(3)]
    assert [a.status_code for a in asked] == [200, 200, 200]
    assert len({a.headers["x-hypic-replica"] for a in asked}) == 1
    # the same chunks in the same order: computed exactly on the repeat, then restored from that replica's snapshot
    usage = [a.json()["usage"] for a in asked]
    assert usage[2]["cached_tokens"] > usage[0]["cached_tokens"] and usage[2]["composed_tokens"] == 0, usage


def _engine_load(url: str, replica: str) -> tuple[float, float]:
    """(running, waiting) generations in one replica's engine (asked by name)."""
    response = httpx.get(f"{url}/metrics", headers={"X-Hypic-Replica": replica}, timeout=30)
    assert response.headers["x-hypic-replica"] == replica
    values = {sample.name: sample.value for family in text_string_to_metric_families(response.text) for sample in family.samples}
    return values.get("hypic_requests_running", 0.0), values.get("hypic_requests_waiting", 0.0)


def test_load_bound_diverts_from_a_saturated_owner(served):
    chunks = [f"Bound {c}: the tower of Tam{c} has {c}{c} bells and a garden on its roof. " * 3 for c in "pqr"]
    owner = _complete(served.url, chunks, "How many bells?").headers["x-hypic-replica"]
    other = next(r for r in served.replicas if r != owner)
    assert _complete(served.url, chunks[::-1], "Where is the garden?").headers["x-hypic-replica"] == owner  # affinity
    # Saturate the owner with long generations sent to it by name (each replica runs one at a
    # time, so one runs and three wait), and wait until its engine reports them: the owner's
    # queue is then 4 above the other's, over the bound (1), for as long as they run. Requests
    # for the owner's chunks sent one at a time meanwhile are routed on those queue lengths.
    busy = {"model": "hypic-tiny", "prompt": "Tell me everything.", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(httpx.post, f"{served.url}/v1/completions", json=busy, headers={"X-Hypic-Replica": owner}, timeout=300)
                for _ in range(4)]
        deadline = time.monotonic() + 60
        while _engine_load(served.url, owner) != (1, 3):
            assert time.monotonic() < deadline, f"the owner never held 4 generations: {_engine_load(served.url, owner)}"
            assert not any(f.done() for f in held), "a long generation ended before the owner held all four"
            time.sleep(0.05)
        routed = [_complete(served.url, chunks, "How many bells?").headers["x-hypic-replica"] for _ in range(3)]
        still_busy = not all(f.done() for f in held)
        assert [f.result().headers["x-hypic-replica"] for f in held] == [owner] * 4
    assert still_busy, "the owner finished its long generations before the probes were routed"
    assert routed == [other] * 3, routed  # without the bound: all on the owner, behind the four


def test_streaming_query_through_serve(served):
    events = []
    body = {"question": "Who is the mayor of Varo2?", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/query", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers.get("x-hypic-replica") and "content-length" not in response.headers  # streamed, not buffered
        event = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
    names = [e for e, _ in events]
    assert names[0] == "sources" and names[-1] == "done" and names.count("delta") >= 2, names
    assert events[0][1]["sources"] and events[-1][1]["usage"]["completion_tokens"] == 300
    text = "".join(data["text"] for e, data in events if e == "delta")
    assert text and events[-1][1]["finish_reason"] == "length"


def test_ingress_refuses_an_oversized_body(served):
    response = httpx.post(f"{served.url}/query", content=b"x" * ((8 << 20) + 1), headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_a_request_naming_a_replica_goes_there(served):
    for rid in served.replicas:
        response = httpx.get(f"{served.url}/metrics", headers={"X-Hypic-Replica": rid}, timeout=30)
        assert response.status_code == 200 and response.headers["x-hypic-replica"] == rid
    unknown = httpx.get(f"{served.url}/health", headers={"X-Hypic-Replica": "no-such-replica"}, timeout=30)
    assert unknown.status_code == 200 and unknown.headers["x-hypic-replica"] in served.replicas  # routed as usual


def test_replicas_share_the_redis_tier(served):
    chunks = [f"Shared {c}: the library of Ines{c} lends {c}{c}{c} maps of the valley each spring. " * 3 for c in "jkl"]
    owner = _complete(served.url, chunks, "How many maps?").headers["x-hypic-replica"]
    other = next(r for r in served.replicas if r != owner)
    deadline = time.monotonic() + 20
    while served.redis.client().dbsize() < 4:  # the owner writes entries to Redis in the background
        assert time.monotonic() < deadline, "the owner's entries never reached Redis"
        time.sleep(0.05)
    before = _hits(served.url, other)
    response = httpx.post(f"{served.url}/v1/completions", headers={"X-Hypic-Replica": other}, timeout=60,
                          json={"model": "hypic-tiny", "prompt": "When?", "segments": chunks, "max_tokens": 2})
    assert response.status_code == 200 and response.headers["x-hypic-replica"] == other
    assert _composed(response) > 0  # computed on the owner, reused on the other replica through Redis
    assert _hits(served.url, other).get("redis", 0) - before.get("redis", 0) >= 3


# --------------------------------------------------------------------------------------------
# Settings travel to replicas; the command line (no Ray started)
# --------------------------------------------------------------------------------------------
def test_settings_travel_with_absolute_paths_and_the_same_seeding(tmp_path, monkeypatch):
    from app.serve_ray.deployments import absolute
    from app.service.runtime import corpus_to_seed
    from app.service.settings import DEFAULT_MODEL, Settings

    monkeypatch.chdir(tmp_path)
    default = absolute(Settings(_env_file=None, model=DEFAULT_MODEL))
    assert default.index_dir == tmp_path / "data" / "index" and default.cache_dir == tmp_path / "data" / "cache"
    assert corpus_to_seed(default) == tmp_path / "data" / "docs_corpus.jsonl"  # the demo corpus still seeds the default index
    tiny = absolute(Settings(_env_file=None, model="hypic-tiny"))
    assert tiny.index_dir == tmp_path / "data" / "hypic-tiny" / "index"
    assert corpus_to_seed(tiny) == tmp_path / "data" / "demo_corpus.jsonl"
    elsewhere = absolute(Settings(_env_file=None, index_dir="mine/index"))
    assert elsewhere.index_dir == tmp_path / "mine" / "index" and corpus_to_seed(elsewhere) is None  # and no other index


def test_serve_ray_command_refuses_a_bad_router_before_starting_anything():
    from typer.testing import CliRunner

    from app.cli import cli

    result = CliRunner().invoke(cli, ["serve-ray", "--router", "random"])
    assert result.exit_code == 1 and "ray_router" in result.output
