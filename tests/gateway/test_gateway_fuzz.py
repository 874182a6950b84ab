"""Schema-driven fuzzing: schemathesis reads the gateway's own OpenAPI document and sends every
operation generated requests, valid and invalid, to a live server (tiny engine, hashing
embedder), checking each response: no 5xx, a documented status, content type and headers, a
body (JSON, or each SSE event) that matches the documented schema, and a 4xx for invalid input.

Seeded and derandomized, so a run repeats exactly. The suite runs 30 examples per operation
and the boundary values of every field (~20 s); the environment changes that, and
`bench/fuzz.py` sets it for long runs:
    HYPIC_FUZZ_EXAMPLES=30  HYPIC_FUZZ_SEED=...  HYPIC_FUZZ_PHASES=examples,coverage,fuzzing
    HYPIC_FUZZ_COLLECT=1   run every example and list all distinct failures at the end
    HYPIC_FUZZ_STRICT=1    nothing is known (below)

ISSUES lists findings not fixed yet. KNOWN says which generated cases trigger each: such a case
is not sent (or is sent without the checks its entry names). PROBES send hostile inputs the
generator does not make (lone surrogates, deep JSON, huge seeds); those of an open issue are
strict xfails. So the suite documents the findings without failing, and when a fix lands its
probes XPASS, which fails the suite until the issue is removed from ISSUES, KNOWN and PROBES.
HYPIC_FUZZ_STRICT=1 runs as if none were known.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402  (schemathesis's transport)
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402

from app.http.server import create_app  # noqa: E402
from app.service.settings import Settings  # noqa: E402
from app.testing import LiveServer, tiny_engine  # noqa: E402
from retrieval import HashingEmbedder, VectorIndex  # noqa: E402

import gateways  # noqa: E402

EXAMPLES = int(os.environ.get("HYPIC_FUZZ_EXAMPLES", "30"))
SEED = int(os.environ.get("HYPIC_FUZZ_SEED", "20240611"))
PHASES = os.environ.get("HYPIC_FUZZ_PHASES", "examples,coverage,fuzzing").split(",")
COLLECT = os.environ.get("HYPIC_FUZZ_COLLECT") == "1"
STRICT = os.environ.get("HYPIC_FUZZ_STRICT") == "1"

CHECKS_RUN = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
              "response_schema_conformance", "response_headers_conformance", "negative_data_rejection")
MODEL = "tiny"
CORPUS = [
    {"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
    {"id": "firm-brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."},
]


# --- what the request holds --------------------------------------------------------------
def parts(case) -> list:
    """What a case sends: body, query, path parameters, headers."""
    return [case.body, case.query, case.path_parameters, case.headers]


def fields(case) -> dict:
    """The top-level fields of a JSON body, or the query parameters."""
    return {**(case.query or {}), **(case.body if isinstance(case.body, dict) else {})}


# Findings not fixed yet, by name. Remove one when its fix lands, with its KNOWN and PROBES uses.
ISSUES: dict[str, str] = {}


@dataclass(frozen=True)
class Known:
    """Which generated cases trigger issue `name`: `matches(case)`. With `checks`, a matching
    case is sent without those checks, else it is not sent."""

    name: str
    matches: Callable[[Any], bool]
    checks: tuple[str, ...] = ()


KNOWN: list[Known] = []


def known(case) -> list[Known]:
    return [] if STRICT else [k for k in KNOWN if k.matches(case)]


# A body declared as text is text whatever schemathesis generates to negate its schema (a
# number, an object): it reaches the server as valid text, so no 4xx is owed for it.
TEXT_BODIES = ("text/plain", "text/markdown", "application/jsonl", "application/x-ndjson")


def harness_skips(case) -> set[str]:
    negative = case.meta is not None and case.meta.generation.mode == GenerationMode.NEGATIVE
    return {"negative_data_rejection"} if negative and case.media_type in TEXT_BODIES else set()


# --- the run -----------------------------------------------------------------------------
def load_schema():
    """The document the live server serves at /openapi.json (it does not depend on what is
    loaded; `test_the_fuzzed_document_is_the_served_one` checks), read at collection so that
    each operation is its own test."""
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "generation": {"mode": "all", "deterministic": True, "max-examples": EXAMPLES},
        "phases": {name: {"enabled": name in PHASES} for name in ("examples", "coverage", "fuzzing", "stateful")},
        "output": {"sanitization": {"enabled": False}},
    })
    return schemathesis.openapi.from_dict(create_app(Settings(_env_file=None)).openapi(), config=config)


schema = load_schema()
# JSONL and Markdown bodies are text: send the generated string as it is.
schemathesis.serializer.alias(["application/jsonl", "application/x-ndjson", "text/markdown"], "text/plain")
FOUND: dict[tuple[str, str, str], str] = {}


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("gateway-fuzz"), tiny_tokenizer, CORPUS,
                          max_top_k=8, max_new_tokens=128, default_top_k=2) as live:
        yield live


def steer(case) -> None:
    """Half the valid cases, chosen by a hash of their data (so a run repeats exactly; a
    `@schema.given` strategy would switch off the coverage phase), name what exists: the
    served model, a stored document. So they get past the 404s, to generation and retrieval."""
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE:
        return
    if zlib.crc32(repr(parts(case)).encode(errors="surrogatepass")) % 2:
        return
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    if "document_id" in (case.path_parameters or {}):
        case.path_parameters["document_id"] = CORPUS[0]["id"]


def checks_for(skipped: set[str]) -> list:
    by_name = {check.__name__: check for check in CHECKS.get_all()}
    return [by_name[name] for name in CHECKS_RUN if name not in skipped]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case, server):
    steer(case)
    found = known(case)
    if any(not k.checks for k in found):
        return
    checks = checks_for({name for k in found for name in k.checks} | harness_skips(case))
    if not COLLECT:
        case.call_and_validate(base_url=server.url, checks=checks, timeout=60)
        return
    try:
        case.call_and_validate(base_url=server.url, checks=checks, timeout=60)
    except (AssertionError, FailureGroup, requests.RequestException) as exc:
        # Grouped by the known findings the case matches (with HYPIC_FUZZ_STRICT=1), so that a new
        # cause of the same symptom is listed apart.
        cause = ",".join(k.name for k in KNOWN if k.matches(case)) or "new"
        for failure in getattr(exc, "exceptions", None) or [exc]:
            message = str(getattr(failure, "message", failure)).strip().split("\n")[0][:100]
            key = (case.operation.label, f"{getattr(failure, 'title', type(failure).__name__)} [{cause}]", message)
            FOUND.setdefault(key, case.as_curl_command())


DEEP = "[" * 100_000 + "]" * 100_000
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Hostile inputs the generator does not make: (method, path, JSON body or (content type, raw body), issue or None).
PROBES = {
    "query-lone-surrogate": ("POST", "/query", {"question": "hi \ud800", "max_tokens": 2}, None),
    "chat-lone-surrogate": ("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\udc00"}]},
                            None),
    "search-lone-surrogate": ("POST", "/search", {"query": "hi \udc00"}, None),
    "documents-lone-surrogate": ("POST", "/documents", {"id": "s", "text": "x \udc00"}, None),
    "chat-seed-2**64": ("POST", "/v1/chat/completions", {**CHAT, "seed": 2**64, "temperature": 1}, None),
    "chat-seed-below-int64": ("POST", "/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1, "temperature": 1}, None),
    "search-top-k-true": ("POST", "/search", {"query": "hi", "top_k": True}, None),
    "query-max-tokens-string": ("POST", "/query", {"question": "hi", "max_tokens": "2"}, None),
    "chat-max-tokens-true": ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": True}, None),
    "completions-max-tokens-float": ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.0}, None),
    "chat-stream-zero": ("POST", "/v1/chat/completions", {**CHAT, "stream": 0}, None),
    "chat-rag-top-k-string": ("POST", "/v1/chat/completions", {**CHAT, "rag": {"top_k": "2"}}, None),
    "chat-content-part-number": ("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, None),
    # sizes and counts (tests/gateway/test_gateway_limits.py has the rest, at small limits)
    "completions-2-mb-prompt": ("POST", "/v1/completions", {"model": MODEL, "prompt": "Varo is a city. " * 131_072}, None),
    "chat-50000-messages": ("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}] * 50_000},
                            None),
    "chat-1000-stops": ("POST", "/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(1000)]}, None),
    "query-2-mb-question": ("POST", "/query", {"question": "who? " * 400_000}, None),
    "search-2-mb-query": ("POST", "/search", {"query": "who? " * 400_000}, None),
    "documents-1-mb-title": ("POST", "/documents", {"id": "t", "text": "x", "title": "T" * (1 << 20)}, None),
    "documents-1-mb-source": ("POST", "/documents", [{"id": "s", "text": "x", "source": "s" * (1 << 20)}], None),
    "documents-jsonl-long-title": ("POST", "/documents", ("application/jsonl", json.dumps({"id": "j", "text": "x", "title": "T" * 600})),
                                   None),
    "documents-list-8-kb-after": ("GET", "/documents?after=" + "a" * 8000, ("application/json", ""), None),  # a longer URL: 431/400 from the server
    "query-deep-json": ("POST", "/query", ("application/json", DEEP), None),
    "chat-deep-json-field": ("POST", "/v1/chat/completions", ("application/json", json.dumps(CHAT)[:-1] + ', "x": ' + DEEP + "}"),
                             None),
    "documents-deep-json": ("POST", "/documents", ("application/json", DEEP), None),
    "documents-deep-jsonl": ("POST", "/documents", ("application/jsonl", '{"id": "a", "text": "b"}\n' + DEEP), None),
}


def probe_params():
    for name, (method, path, body, issue) in PROBES.items():
        marks = [pytest.mark.xfail(strict=True, reason=f"{issue}: {ISSUES[issue]}")] if issue and not STRICT else []
        yield pytest.param(method, path, body, id=name, marks=marks)


@pytest.mark.parametrize(("method", "path", "body"), list(probe_params()))
def test_hostile_input_is_a_4xx_with_the_error_body(server, method, path, body):
    """Strict xfail while its issue is open: once fixed, the XPASS fails the suite until the
    issue is removed from ISSUES, KNOWN and PROBES."""
    content_type, content = body if isinstance(body, tuple) else ("application/json", json.dumps(body))
    r = httpx.request(method, server.url + path, content=content.encode("utf-8", "surrogatepass"),
                      headers={"content-type": content_type}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"


TINY = {"temperature": 1e-40, "top_p": 1e-46, "repetition_penalty": 1e-50}


@pytest.mark.parametrize("field", TINY)
def test_tiny_sampling_values_sample_without_a_server_error(server, field):
    """Valid but tiny sampling values (they once overflowed to NaN probabilities: a 500)."""
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "temperature": 1, field: TINY[field]},
                   timeout=60)
    assert r.status_code == 200, r.text[:300]


STREAMS = {
    "query": ("/query", {"question": "Who is the mayor of Varo?", "max_tokens": 4, "stream": True}),
    "chat-rag-usage": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Varo?"}], "max_tokens": 4,
                                                "stream": True, "stream_options": {"include_usage": True}, "rag": {"top_k": 2},
                                                "logprobs": True, "top_logprobs": 2}),
    "completion-logprobs": ("/v1/completions", {"model": MODEL, "prompt": "Varo is", "max_tokens": 4, "stream": True, "logprobs": 2,
                                                "segments": ["Varo is a city."]}),
}


@pytest.mark.parametrize("name", STREAMS)
def test_streams_answer_as_documented(server, name):
    """Each SSE event of a real stream matches the documented event schemas (whatever the fuzzer draws)."""
    path, body = STREAMS[name]
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(base_url=server.url, checks=checks_for(set()), timeout=60)
    assert response.headers["content-type"][0].startswith("text/event-stream")


def test_collected_failures():
    """With HYPIC_FUZZ_COLLECT=1 every operation runs all its examples, and this lists the
    distinct failures; without, an operation's first failure (shrunk) fails its own test."""
    if not COLLECT:
        pytest.skip("HYPIC_FUZZ_COLLECT is off")
    report = [f"{op} | {title} | {message}\n    {curl[:3000]}" for (op, title, message), curl in sorted(FOUND.items())]
    assert not FOUND, f"{len(FOUND)} distinct failures:\n" + "\n".join(report)


def test_answers_the_fuzzer_cannot_reach_are_as_documented(tiny_tokenizer, tmp_path):
    """503 while loading (Retry-After), 413 over the body limit, 415 for an unknown content type."""
    gate = threading.Event()
    engine = tiny_engine(tiny_tokenizer)
    settings = Settings(_env_file=None, torch_threads=None, index_dir=tmp_path / "index", max_body_bytes=2000)
    app = create_app(settings, engine=lambda: (gate.wait(30), engine)[1],
                     index=lambda: VectorIndex(settings.index_dir, HashingEmbedder(64)))
    checks = checks_for(set())
    with LiveServer(app) as live:
        for path, method, body in (("/ready", "GET", None), ("/v1/models", "GET", None), ("/search", "POST", {"query": "x"}),
                                   ("/query", "POST", {"question": "x"})):
            case = schema[path][method].Case(**({"body": body, "media_type": "application/json"} if body else {}))
            response = case.call_and_validate(base_url=live.url, checks=checks_for({"not_a_server_error"}))  # a 503 is owed
            assert response.status_code == 503
        gate.set()
        live.wait_ready()
        too_big = schema["/query"]["POST"].Case(body={"question": "x" * 3000}, media_type="application/json")
        assert too_big.call_and_validate(base_url=live.url, checks=checks).status_code == 413
        upload = schema["/documents"]["POST"].Case(body="<doc/>", media_type="text/plain", query={"id": "x"})
        response = httpx.post(f"{live.url}/documents?id=x", content="<doc/>", headers={"content-type": "application/xml"})
        upload.validate_response(response, checks=checks)
        assert response.status_code == 415


# --- the document ------------------------------------------------------------------------
def test_the_fuzzed_document_is_the_served_one(server):
    assert httpx.get(f"{server.url}/openapi.json").json() == schema.raw_schema


def test_openapi_document_is_complete():
    """Every operation documents its success and error bodies; no 422 (validation errors are 400s)."""
    doc = schema.raw_schema
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "422" not in codes, (method, path)
            assert codes & {"200", "201"}, (method, path)
            for code, response in operation["responses"].items():
                for media, content in response.get("content", {}).items():
                    assert content.get("schema") not in (None, {}), (method, path, code, media)
    assert set(doc["paths"]["/documents"]["post"]["requestBody"]["content"]) >= {
        "application/json", "application/jsonl", "multipart/form-data", "text/plain", "text/markdown"}


def test_with_an_api_key_the_document_names_the_bearer_scheme():
    doc = create_app(Settings(_env_file=None, api_key="secret")).openapi()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/query"]["post"]["security"] == [{"bearer": []}]
    assert "401" in doc["paths"]["/query"]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"] and "401" not in doc["paths"]["/ready"]["get"]["responses"]
