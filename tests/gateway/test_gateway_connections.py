"""Connections and browsers against live servers: Host allowlist (DNS rebinding), cross-site
writes without an API key, the Authorization header, header limits and the deadlines on a
request's head and body (slowloris).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from app.http.connections import uvicorn_options
from app.service.settings import Settings
from app.testing import LiveServer

import gateways

UI = "http://ui.example"
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def make_engine(tiny_tokenizer):
    """Makes a tiny engine for each gateway: the module-scoped gateways below stay up while the tests
    start others, and an engine serves one gateway at a time (Engine.driver)."""
    def make():
        with gateways.engine(tiny_tokenizer) as engine:
            return engine
    return make


def start(make_engine, root, **overrides) -> LiveServer:
    live = LiveServer(gateways.app(root, make_engine(), **overrides)).start()
    live.wait_ready()
    return live


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    """No API key (the default), one allowed browser origin, short deadlines, few headers."""
    live = start(make_engine, tmp_path_factory.mktemp("connections"), cors_origins=[UI], header_timeout_s=1.0, body_timeout_s=1.0,
                 max_headers=30, max_header_bytes=4096)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def keyed(make_engine, tmp_path_factory):
    live = start(make_engine, tmp_path_factory.mktemp("connections-key"), api_key="sekret")
    yield live
    live.stop()


def refused(r: httpx.Response, param: str, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    return error


def document_exists(server: LiveServer, document_id: str) -> bool:
    return httpx.get(f"{server.url}/documents/{document_id}").status_code == 200


# Host allowlist

def test_unlisted_host_is_refused_but_probes_answer_any_host(server):
    r = httpx.get(f"{server.url}/documents", headers={"Host": "evil.example"})
    assert refused(r, "host", 400)["code"] == "host_not_allowed"
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:8000"):
        assert httpx.get(f"{server.url}/documents", headers={"Host": host}).status_code == 200, host
    for probe in ("/health", "/ready", "/metrics"):  # Docker and Kubernetes probes use whatever address they reach
        assert httpx.get(f"{server.url}{probe}", headers={"Host": "10.1.2.3:8000"}).status_code == 200


def test_allowed_hosts_setting(make_engine, tmp_path):
    live = start(make_engine, tmp_path, allowed_hosts=["api.example.com", "*.internal.example"])
    try:
        for host, status in [("api.example.com", 200), ("a.internal.example:8000", 200), ("localhost", 200),
                             ("internal.example", 400), ("api.example.com.evil.example", 400)]:
            assert httpx.get(f"{live.url}/documents", headers={"Host": host}).status_code == status, host
    finally:
        live.stop()


@pytest.mark.parametrize("host,allowed_hosts,expected", [
    ("127.0.0.1", None, ["localhost", "127.0.0.1", "[::1]"]),
    ("0.0.0.0", None, ["*"]),  # all interfaces: the compose service name, a LAN address...
    ("::", None, ["*"]),
    ("10.0.0.5", None, ["localhost", "127.0.0.1", "[::1]", "10.0.0.5"]),
    ("0.0.0.0", ["gateway"], ["gateway", "localhost", "127.0.0.1", "[::1]"]),
    ("127.0.0.1", ["*"], ["*"]),
])
def test_trusted_hosts_default_follows_the_bound_address(host, allowed_hosts, expected):
    settings = Settings(_env_file=None, host=host, **({} if allowed_hosts is None else {"allowed_hosts": allowed_hosts}))
    assert settings.trusted_hosts == expected


# Cross-site writes without an API key

@pytest.mark.parametrize("method,path,kwargs", [
    ("POST", "/documents?id=planted", {"content": "planted text", "headers": {"content-type": "text/plain"}}),
    ("POST", "/documents", {"json": {"id": "planted", "text": "planted text"}}),
    ("POST", "/documents", {"files": {"file": ("planted", b"planted text")}}),
    ("POST", "/query", {"json": {"question": "q", "max_tokens": 1}}),
    ("DELETE", "/documents/planted", {}),
], ids=["text", "json", "multipart", "query", "delete"])
def test_writes_from_another_origin_are_403(server, method, path, kwargs):
    headers = kwargs.pop("headers", {}) | {"Origin": EVIL, "X-Requested-With": "x"}
    r = httpx.request(method, f"{server.url}{path}", headers=headers, **kwargs)
    assert refused(r, "origin", 403)["code"] == "origin_not_allowed"
    assert not document_exists(server, "planted")
    for origin in ("null", "http://[::1"):  # sandboxed pages; not a URL
        refused(httpx.request(method, f"{server.url}{path}", headers=headers | {"Origin": origin}, **kwargs), "origin", 403)


def test_writes_from_the_listed_or_the_gateways_own_origin_pass(server):
    for origin in (UI, f"http://127.0.0.1:{server.port}"):  # the second: the gateway's own /docs page
        r = httpx.post(f"{server.url}/documents", json={"id": "from-page", "text": "page text"}, headers={"Origin": origin})
        assert r.status_code == 201, (origin, r.text)
    assert httpx.get(f"{server.url}/documents", headers={"Origin": EVIL}).status_code == 200  # reads: CORS keeps the answer from the page
    assert httpx.delete(f"{server.url}/documents/from-page", headers={"Origin": UI}).status_code == 200


def test_text_upload_needs_a_header_a_page_cannot_add_unasked(server):
    r = httpx.post(f"{server.url}/documents?id=plain", content="plain text", headers={"content-type": "text/plain; charset=utf-8"})
    assert refused(r, "content-type", 403)["code"] == "simple_request_refused"
    assert not document_exists(server, "plain")
    ok = httpx.post(f"{server.url}/documents?id=plain", content="plain text", headers={"content-type": "text/plain", "X-Requested-With": "curl"})
    assert ok.status_code == 201, ok.text
    md = httpx.post(f"{server.url}/documents?id=plain", content="# Plain\n\ntext", headers={"content-type": "text/markdown"})
    assert md.status_code == 201, md.text


def test_a_form_upload_needs_the_header_or_an_origin(server):
    """Before: a multipart upload with neither Origin nor X-Requested-With was accepted without an
    API key, although a page on any site (in an older browser, which sent no Origin with a form)
    can send one unasked."""
    form = {"files": {"file": ("formed.txt", b"form text")}}
    r = httpx.post(f"{server.url}/documents", **form)
    assert refused(r, "content-type", 403)["code"] == "simple_request_refused"
    assert not document_exists(server, "formed.txt")
    urlencoded = httpx.post(f"{server.url}/documents", data={"id": "formed.txt"})
    assert refused(urlencoded, "content-type", 403)["code"] == "simple_request_refused"
    for headers in ({"X-Requested-With": "curl"}, {"Origin": UI}):
        ok = httpx.post(f"{server.url}/documents", headers=headers, **form)
        assert ok.status_code == 201, (headers, ok.text)


def test_preflight_allows_the_listed_origin_to_send_x_requested_with(server):
    preflight = httpx.options(f"{server.url}/documents", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type, x-requested-with"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == UI


def test_an_api_key_authenticates_writes_from_any_origin(keyed):
    key = {"Authorization": "Bearer sekret"}
    r = httpx.post(f"{keyed.url}/documents?id=k", content="text", headers=key | {"Origin": EVIL, "content-type": "text/plain"})
    assert r.status_code == 201, r.text


# Authorization

def test_two_authorization_headers_are_a_400(keyed):
    for values in (["Bearer wrong", "Bearer sekret"], ["Bearer sekret", "Bearer sekret"]):
        r = httpx.get(f"{keyed.url}/documents", headers=[("Authorization", v) for v in values])
        refused(r, "authorization", 400)


@pytest.mark.parametrize("value,status", [("Bearer sekret", 200), ("bearer sekret", 200), ("BEARER  sekret", 200),
                                          ("Basic sekret", 401), ("Bearer wrong", 401), ("sekret", 401), ("Bearer", 401)])
def test_bearer_scheme_in_any_case(keyed, value, status):
    assert httpx.get(f"{keyed.url}/documents", headers={"Authorization": value}).status_code == status


# Header limits and deadlines

def raw_exchange(server: LiveServer, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; (everything received until the server closes it, seconds it took)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        if data:
            s.sendall(data)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except ConnectionResetError:  # the server closed with some of `data` unread
            pass
    return received, time.monotonic() - started


def test_too_many_or_too_large_headers_are_431(server):
    many = httpx.get(f"{server.url}/documents", headers={f"x-h{i}": "v" for i in range(40)})
    assert refused(many, "headers", 431)["code"] == "headers_too_large"
    head = f"GET /documents HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: {'v' * 6000}\r\n\r\n".encode()
    answer, _ = raw_exchange(server, head)
    assert answer.split(b" ", 2)[1] in (b"431", b"400")  # 400: h11's limit, when the head arrived in pieces
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_silent_connection_is_closed(server):
    answer, seconds = raw_exchange(server, b"")
    assert answer == b"" and 0.9 < seconds < 5


def test_a_slow_head_gets_408_and_the_connection_closes(server):
    """Slowloris: a header line every quarter second. The deadline (1 s here) counts from the
    connection's start, so the lines do not extend it: the 408 comes at about 1 s, not 1 s
    after the last line (1.75 s)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /query HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(3):  # then stop, well before the deadline: the server reads everything before it closes
            time.sleep(0.25)
            s.sendall(b"x-slow: 1\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"param": "headers"' in answer and time.monotonic() - started < 1.7


def test_a_stalled_body_gets_408(server):
    head = b"POST /documents HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    answer, seconds = raw_exchange(server, head + b'{"id": "sl')
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408") and b'"param":"body"' in rest and b'"code":"body_timeout"' in rest, answer
    assert seconds < 5  # answered and closed, not kept open
    assert not document_exists(server, "sl")


def test_a_trickling_body_gets_408_at_its_deadline(make_engine, tmp_path):
    """A byte every 0.3 s never trips the idle deadline (1 s); before, nothing else bounded it
    (a byte every 5-20 s held the connection for as long as the client liked). Now the whole
    body must arrive within body_deadline_s (1.5 s here) of the head."""
    live = start(make_engine, tmp_path, body_timeout_s=1.0, body_deadline_s=1.5)
    try:
        head = b"POST /documents HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        started = time.monotonic()
        answer = b""
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
            s.sendall(head)
            s.setblocking(False)
            while time.monotonic() - started < 6 and not answer:
                try:
                    s.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.3)
                try:
                    answer = s.recv(65536)
                except BlockingIOError:
                    pass
        assert answer.startswith(b"HTTP/1.1 408") and b"within 1.5 s" in answer, answer
        assert time.monotonic() - started < 3.5
    finally:
        live.stop()


def test_connections_kept_alive_between_requests_still_work(server):
    with httpx.Client(base_url=server.url) as client:
        for _ in range(3):
            assert client.get("/documents").status_code == 200
            time.sleep(0.6)  # under keep_alive_timeout_s; with the head deadline at 1 s, each request re-arms it


def test_uvicorn_options_carry_the_settings():
    options = uvicorn_options(Settings(_env_file=None, keep_alive_timeout_s=3, header_timeout_s=7, max_header_bytes=8192))
    assert options["timeout_keep_alive"] == 3 and options["h11_max_incomplete_event_size"] == 8192
    assert options["http"].head_timeout == 7
