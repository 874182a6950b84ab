"""Operations against live servers: readiness, metrics, concurrency, admission, disconnects,
API keys and the body limit.

The engine never stops at EOS here (`stop_at_eos=False`), so a generation runs to max_tokens
unless something stops it: a long request that ends early was aborted.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import threading
import time
import traceback

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.http.server import create_app
from app.http.sse import parse
from app.service.settings import Settings
from app.testing import LiveServer
from hypic_core.engine.engine import Engine, StepOutput
from retrieval import HashingEmbedder, VectorIndex

import gateways

LONG = 1000  # tokens: several seconds of decoding, far longer than any test waits


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    with gateways.engine(tiny_tokenizer, stop_at_eos=False) as engine:
        yield engine


settings_for = gateways.settings


def empty_index(tmp_path) -> VectorIndex:
    return VectorIndex(tmp_path / "index", HashingEmbedder(64))


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    """A gateway over an engine of its own: the tests below serve `engine` from gateways of their own
    while this one is up (an engine has one gateway at a time: Engine.driver)."""
    root = tmp_path_factory.mktemp("gateway-ops")
    with gateways.engine(tiny_tokenizer, stop_at_eos=False) as own, \
            gateways.served(gateways.app(root, own, max_running=2, max_queue=1, max_body_bytes=4096, retry_after_s=3)) as live:
        yield live


def metric(url: str, name: str, **labels) -> float:
    """The value of sample `name` with `labels` on /metrics (0 if absent)."""
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def idle(url: str) -> bool:
    return metric(url, "hypic_requests_running") == 0 and metric(url, "hypic_requests_waiting") == 0


def open_stream(url: str, max_tokens: int = LONG):
    """Start a streaming /query; returns (client, response) once its headers arrived."""
    client = httpx.Client(timeout=30)
    request = client.build_request("POST", f"{url}/query", json={"question": "a long story", "max_tokens": max_tokens, "stream": True})
    return client, client.send(request, stream=True)


def test_metrics_increase_after_a_request(server):
    before_ok = metric(server.url, "hypic_requests_total", route="/query", status="200")
    before_ttft = metric(server.url, "hypic_time_to_first_token_seconds_count", route="/query")
    before_tokens = metric(server.url, "hypic_generated_tokens_total")
    before_prompt = sum(metric(server.url, "hypic_prompt_tokens_total", kind=k) for k in ("exact", "composed", "seam", "fresh"))
    r = httpx.post(f"{server.url}/query", json={"question": "count to five", "max_tokens": 5}, timeout=30)
    assert r.status_code == 200
    assert metric(server.url, "hypic_requests_total", route="/query", status="200") == before_ok + 1
    assert metric(server.url, "hypic_time_to_first_token_seconds_count", route="/query") == before_ttft + 1
    assert metric(server.url, "hypic_generated_tokens_total") == before_tokens + 5
    assert metric(server.url, "hypic_inter_token_latency_seconds_count") >= 4
    assert metric(server.url, "hypic_e2e_latency_seconds_count", route="/query") >= 1
    assert metric(server.url, "hypic_retrieval_seconds_count") >= 1
    assert metric(server.url, "hypic_prompt_tokens_total", kind="fresh") > 0
    kinds = sum(metric(server.url, "hypic_prompt_tokens_total", kind=k) for k in ("exact", "composed", "seam", "fresh"))
    assert kinds == r.json()["usage"]["prompt_tokens"] + before_prompt  # a partition: the kinds sum to the prompt
    text = httpx.get(f"{server.url}/metrics").text
    assert "hypic_cache_hits_total" in text and "hypic_cache_misses_total" in text and "hypic_cache_lookups_total" in text
    assert 'model_name="tiny"' in text and "process_cpu_seconds_total" in text
    assert "hypic_requests_running" in text and "hypic_requests_waiting" in text


def test_concurrent_streams_interleave(server):
    """Two streams served at once: each gets its first token before the other one finishes."""
    marks: dict[int, dict[str, float]] = {0: {}, 1: {}}

    def run(i: int) -> None:
        with httpx.stream("POST", f"{server.url}/query", json={"question": f"stream {i}", "max_tokens": 60, "stream": True}, timeout=30) as r:
            for name, _ in parse(r.iter_lines()):
                if name == "delta":
                    marks[i].setdefault("first", time.monotonic())
                elif name == "done":
                    marks[i]["done"] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all("done" in m for m in marks.values()), marks
    assert marks[0]["first"] < marks[1]["done"] and marks[1]["first"] < marks[0]["done"]


def test_client_disconnect_mid_stream_aborts_generation(server):
    wait_for(lambda: idle(server.url))
    aborted = metric(server.url, "hypic_generations_finished_total", reason="abort")
    tokens = metric(server.url, "hypic_generated_tokens_total")
    client, response = open_stream(server.url)
    for name, _ in parse(response.iter_lines()):
        if name == "delta":
            break
    response.close()
    client.close()
    started = time.monotonic()
    wait_for(lambda: metric(server.url, "hypic_generations_finished_total", reason="abort") == aborted + 1, timeout=5)
    wait_for(lambda: idle(server.url), timeout=5)
    assert time.monotonic() - started < 5
    assert metric(server.url, "hypic_generated_tokens_total") - tokens < LONG / 2


def test_client_disconnect_during_non_streaming_request_aborts_generation(server):
    wait_for(lambda: idle(server.url))
    aborted = metric(server.url, "hypic_generations_finished_total", reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/query", json={"question": "a long story", "max_tokens": LONG}, timeout=0.5)
    wait_for(lambda: metric(server.url, "hypic_generations_finished_total", reason="abort") == aborted + 1, timeout=5)
    wait_for(lambda: idle(server.url), timeout=5)


def test_full_queue_answers_429_with_retry_after(server):
    wait_for(lambda: idle(server.url))
    streams = [open_stream(server.url) for _ in range(3)]  # 2 running + 1 waiting = capacity
    try:
        wait_for(lambda: metric(server.url, "hypic_requests_waiting") == 1)
        r = httpx.post(f"{server.url}/query", json={"question": "one more", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "queue_full"
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            oai.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert metric(server.url, "hypic_requests_rejected_total") >= 2
    finally:
        for client, response in streams:
            response.close()
            client.close()
    wait_for(lambda: idle(server.url), timeout=10)
    assert httpx.post(f"{server.url}/query", json={"question": "after", "max_tokens": 2}, timeout=30).status_code == 200


def test_body_limit_is_413(server):
    big = "x" * 5000
    r = httpx.post(f"{server.url}/documents?id=big", content=big, headers={"content-type": "text/markdown"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = httpx.post(f"{server.url}/query", json={"question": big})
    assert r.status_code == 413
    chunked = httpx.post(f"{server.url}/documents?id=big", content=iter([big.encode()] * 2), headers={"content-type": "text/markdown"})
    assert chunked.status_code == 413


def test_ready_is_503_until_loaded(engine, tmp_path):
    gate = threading.Event()

    def slow_engine():
        gate.wait(30)
        return engine

    app = create_app(settings_for(tmp_path), engine=slow_engine, index=lambda: empty_index(tmp_path))
    with LiveServer(app) as live:
        r = httpx.get(f"{live.url}/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"]
        assert httpx.get(f"{live.url}/health").status_code == 200
        q = httpx.post(f"{live.url}/query", json={"question": "too early"})
        assert q.status_code == 503 and q.json()["error"]["code"] == "not_ready"
        gate.set()
        live.wait_ready(timeout=10)
        assert httpx.get(f"{live.url}/ready").json()["status"] == "ready"
        assert httpx.post(f"{live.url}/query", json={"question": "now", "max_tokens": 2}, timeout=30).status_code == 200


def test_an_engine_serves_one_gateway_at_a_time(engine, tmp_path):
    """A second gateway over an engine another one serves fails to load, saying why (its steps would
    take the first one's outputs and drop them); once the first is closed, the engine is free."""
    with LiveServer(create_app(settings_for(tmp_path / "a"), engine=engine, index=empty_index(tmp_path / "a"))) as first:
        first.wait_ready()
        with LiveServer(create_app(settings_for(tmp_path / "b"), engine=engine, index=empty_index(tmp_path / "b"))) as second:
            wait_for(lambda: httpx.get(f"{second.url}/ready").json()["status"] == "failed")
            ready = httpx.get(f"{second.url}/ready")
            assert ready.status_code == 503 and "already driven by the engine thread of a gateway" in ready.json()["error"]
        assert httpx.post(f"{first.url}/query", json={"question": "still mine", "max_tokens": 2}, timeout=30).status_code == 200
    with LiveServer(create_app(settings_for(tmp_path / "c"), engine=engine, index=empty_index(tmp_path / "c"))) as third:
        third.wait_ready()
        assert httpx.post(f"{third.url}/query", json={"question": "free again", "max_tokens": 2}, timeout=30).status_code == 200


def test_an_engine_thread_frees_its_engine_when_it_stops_and_claims_none_once_closed(engine):
    from app.service.engine_thread import EngineThread
    from app.service.metrics import Metrics

    thread = EngineThread(1, 0, Metrics("tiny"))
    thread.attach(engine)
    assert engine.driver.holder is thread
    thread.close()
    assert engine.driver.holder is None and not thread.alive
    with pytest.raises(RuntimeError, match="closed"):  # a gateway closed while loading never holds the engine
        thread.attach(engine)
    assert engine.driver.holder is None


def test_failed_loading_is_reported_by_ready(tmp_path):
    def broken():
        raise OSError("no weights here")

    with LiveServer(create_app(settings_for(tmp_path), engine=broken, index=lambda: empty_index(tmp_path))) as live:
        wait_for(lambda: httpx.get(f"{live.url}/ready").json()["status"] == "failed")
        assert "no weights here" in httpx.get(f"{live.url}/ready").json()["error"]
        assert httpx.get(f"{live.url}/health").status_code == 200


def test_api_key_is_enforced_and_cors_preflight_passes(engine, tmp_path):
    settings = settings_for(tmp_path, api_key="sekret", cors_origins=["http://ui.example"])
    app = create_app(settings, engine=engine, index=empty_index(tmp_path))
    with LiveServer(app) as live:
        live.wait_ready()
        body = {"question": "q", "max_tokens": 1}
        missing = httpx.post(f"{live.url}/query", json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["param"] == "authorization" and missing.headers["x-request-id"]
        assert httpx.post(f"{live.url}/query", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{live.url}/documents").status_code == 401
        assert httpx.post(f"{live.url}/query", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{live.url}{open_path}").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0).models.list().data[0].id == "tiny"
        preflight = httpx.options(f"{live.url}/query", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        cross = httpx.post(f"{live.url}/query", json=body, headers={"Authorization": "Bearer sekret", "Origin": "http://ui.example"})
        assert cross.headers["access-control-allow-origin"] == "http://ui.example"
        assert "x-request-id" in cross.headers["access-control-expose-headers"].lower()


class FailingEngine(Engine):
    """Prefills and samples a first token, then every decode forward fails as a broken device would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def device_lost(*_args, **_kwargs):
            raise RuntimeError("device lost")

        self.runner.batch.forward = device_lost
        next_token = self.output.next_token

        def first_is_partial(seq, logits, draft=None) -> StepOutput:
            out = next_token(seq, logits, draft)
            return dataclasses.replace(out, text="partial answer") if out.index == 0 else out

        self.output.next_token = first_is_partial


def test_engine_failure_mid_stream_ends_with_a_failure_event(engine, tmp_path, caplog):
    """The client gets a failure event; the log gets the exception with its traceback (before:
    only its repr, so a failure seen once, as under Ray's pow2 routing, could not be traced)."""
    failing = FailingEngine(engine.model, engine.tokenizer, engine.config, model_id="tiny")
    with caplog.at_level(logging.WARNING, logger="hypic"), \
            LiveServer(create_app(settings_for(tmp_path), engine=failing, index=empty_index(tmp_path))) as live:
        live.wait_ready()
        with httpx.stream("POST", f"{live.url}/query", json={"question": "q", "max_tokens": 5, "ignore_eos": True, "stream": True}) as r:
            events = list(parse(r.iter_lines()))
        assert [name for name, _ in events][0] == "sources" and events[-1][0] == "failure"
        assert [json.loads(data) for name, data in events if name == "delta"] == [{"text": "partial answer"}]
        assert json.loads(events[-1][1])["error"]["type"] == "server_error"
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 5, "ignore_eos": True, "stream": True}) as r:
            data = [d for _, d in parse(r.iter_lines())]
        assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
        whole = httpx.post(f"{live.url}/query", json={"question": "q", "max_tokens": 5, "ignore_eos": True})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error" and whole.headers["x-request-id"]
        assert httpx.get(f"{live.url}/health").status_code == 200
    failed = [r for r in caplog.records if r.getMessage() == "generation failed"]
    assert len(failed) == 3 and all(r.exc_info and r.exc_info[1].args == ("device lost",) for r in failed)
    assert all("device_lost" in "".join(traceback.format_exception(*r.exc_info)) for r in failed)  # where it was raised


def test_loads_model_index_and_disk_cache_from_settings(engine, tmp_path):
    """No injected objects: the app loads the checkpoint, builds a hashing index, ingests the
    corpus and caches segments on disk, all from settings."""
    model_dir = tmp_path / "model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "a", "text": "Varo lies on the Alna."}\n{"id": "b", "text": "Brill was founded by Tam Oke."}\n')
    settings = Settings(_env_file=None, torch_threads=None, model=str(model_dir), index_dir=tmp_path / "index",
                        corpus_path=corpus, embedder="hashing-64", cache_dir=tmp_path / "cache", seam=2,
                        exact_repeats=False)  # the repeat composes from the segment cache (not an exact run)
    with LiveServer(create_app(settings)) as live:
        live.wait_ready()
        assert httpx.get(f"{live.url}/ready").json() == {"status": "ready", "model": "model", "chunks": 2}
        body = {"question": "Where is Varo?", "top_k": 2, "max_tokens": 2}
        first = httpx.post(f"{live.url}/query", json=body, timeout=30).json()
        second = httpx.post(f"{live.url}/query", json=body, timeout=30).json()
        assert {s["document_id"] for s in first["sources"]} == {"a", "b"}
        assert second["usage"]["composed_tokens"] > first["usage"]["composed_tokens"]
        assert second["usage"]["cached_tokens"] > first["usage"]["cached_tokens"]  # the system prompt, exactly
        assert metric(live.url, "hypic_cache_hits_total", tier="host") >= 2  # two documents (the system prompt: exact)
        wait_for(lambda: metric(live.url, "hypic_cache_bytes", tier="disk") > 0)  # written in the background
