"""The page at `/` (app/http/page.py, app/http/static/) and the per-source `reuse` of /query it shows.

One gateway for the module: the bundled model (models/hypic-tiny), its synthetic demo corpus
(data/demo_corpus.jsonl) and the default embedder, with an API key, so the page must carry it.
- `reuse` (per source: reused / seam / computed tokens) adds up to `usage` in every mode, cold
  and warm, and each source's tokens are its chunk's segment as the prompter builds it;
- the page's files are open (GET, no key) while the API stays closed, and an unknown path is
  still the API's JSON 404;
- in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium): type the key,
  ask, see the streamed answer, the sources and the per-chunk reuse (computed, then reused when
  asked again, the same numbers the API gives), compare with `full`, add a document and get it
  cited. Skipped only when /usr/bin/chromium is absent and HYPIC_REQUIRE_BROWSER is unset
  (.ci/run sets it and installs the browser).

`python tests/gateway/test_page.py --model smollm2-hybrid-135m-reuse --out docs/page.png` drives the
same page to a screenshot (see `main`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1500"]
# A made-up fact, in no model's training text: only the uploaded document can answer it.
UPLOAD = {"id": "quorvath-lighthouse", "title": "The Quorvath lighthouse",
          "text": "The Quorvath lighthouse stands on the island of Pelmurra. Its keeper is Zelmira Tonbakke, since 1931."}


def gateway_settings(root: Path, model: str = "hypic-tiny", corpus: Path | None = ROOT / "data" / "demo_corpus.jsonl", **overrides):
    import gateways

    return gateways.settings(root, model=model, corpus_path=corpus, api_key=KEY, max_new_tokens=256, **overrides)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import gateways
    from app.http.server import create_app

    with gateways.served(create_app(gateway_settings(tmp_path_factory.mktemp("page"))), headers=AUTH) as live:
        yield live


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        yield c


def ask(client: httpx.Client, **body) -> dict:
    r = client.post("/query", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# --- /query's reuse ------------------------------------------------------------------------------
def check_adds_up(body: dict) -> None:
    """`reuse` against `usage`: one entry per source, in order; each partitions its chunk's tokens; the
    composed and seam tokens are all the sources' (the system prompt is an exact prefix, never stitched)."""
    reuse, usage = body["reuse"], body["usage"]
    assert [r["chunk_id"] for r in reuse] == [s["chunk_id"] for s in body["sources"]]
    for r in reuse:
        assert set(r) == {"chunk_id", "how", "tokens", "reused", "seam", "computed"}
        assert min(r["reused"], r["seam"], r["computed"]) >= 0 and r["tokens"] == r["reused"] + r["seam"] + r["computed"]
        assert (r["how"] == "computed") == (r["reused"] == 0)
    assert sum(r["reused"] for r in reuse if r["how"] == "composed") == usage["composed_tokens"]
    assert sum(r["seam"] for r in reuse) == usage["seam_tokens"]
    assert sum(r["reused"] for r in reuse if r["how"] == "exact") <= usage["cached_tokens"]
    assert usage["prompt_tokens"] - usage["cached_tokens"] - usage["composed_tokens"] - usage["seam_tokens"] >= sum(
        r["computed"] for r in reuse)


def test_reuse_per_source_adds_up_to_usage_in_every_mode(server, client):
    prompter = server.server.config.app.state.runtime.prompter
    for i, mode in enumerate(("hypic", "pic-naive", "prefix", "full")):
        question = f"Who is the mayor of {['Bajend', 'Brerond', 'Bubork', 'Fuwum'][i]}?"
        cold = ask(client, question=question, top_k=3, mode=mode)
        warm = ask(client, question=question, top_k=3, mode=mode)
        for body in (cold, warm):
            check_adds_up(body)
            # each source's tokens are its chunk's segment, wherever the prompter placed it
            assert [r["tokens"] for r in body["reuse"]] == [len(prompter.document(s["text"], s["title"])) for s in body["sources"]]
        assert all(r["how"] == "computed" for r in cold["reuse"]), (mode, cold["reuse"])  # first sighting
        expected = {"hypic": "composed", "pic-naive": "composed", "prefix": "exact", "full": "computed"}[mode]
        assert {r["how"] for r in warm["reuse"]} == {expected}, (mode, warm["reuse"])
        if mode in ("hypic", "pic-naive"):
            assert all(r["seam"] == min(8, r["tokens"]) for r in warm["reuse"])  # the default seam
        if mode == "full":
            assert all(r["seam"] == 0 and r["computed"] == r["tokens"] for r in warm["reuse"])


def test_the_stream_carries_the_same_reuse(client):
    from app.http.sse import parse

    body = {"question": "Which river flows through Dretround?", "top_k": 2, "mode": "hypic"}
    ask(client, **body)  # cold: the chunks are computed and kept
    warm = ask(client, **body)
    with client.stream("POST", "/query", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        events = [(name, json.loads(data)) for name, data in parse(response.iter_lines())]
    done = events[-1]
    assert done[0] == "done"
    assert done[1]["reuse"] == warm["reuse"] and done[1]["usage"] == warm["usage"]
    assert {r["how"] for r in warm["reuse"]} == {"composed"}


# --- the page's files ------------------------------------------------------------------------------
def test_the_page_is_open_and_the_api_is_not(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for path, kind in (("/", "text/html"), ("/page.js", "text/javascript"), ("/page.css", "text/css")):
            r = anonymous.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.status_code)
            assert "connect-src 'self'" in r.headers["content-security-policy"] and r.headers["x-content-type-options"] == "nosniff"
        page = anonymous.get("/").text
        assert 'src="/page.js"' in page and 'href="/page.css"' in page and "http" not in page.split("<footer")[0]
        assert anonymous.post("/query", json={"question": "Who is the mayor of Bajend?"}).status_code == 401
        assert anonymous.post("/", json={}).status_code == 401  # only GET is open
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as keyed:
        r = keyed.get("/no-such-route")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_the_page_fetches_nothing_from_elsewhere():
    static = ROOT / "app" / "http" / "static"
    assert sorted(p.name for p in static.iterdir()) == ["index.html", "page.css", "page.js"]
    for path in static.iterdir():
        text = path.read_text()
        for scheme in ("http://", "https://", "//cdn", "@import"):
            assert scheme not in text, (path.name, scheme)


# --- in a browser ------------------------------------------------------------------------------------
def browser_or_skip():
    """A headless Chromium under Selenium, from Debian's packages (never downloaded)."""
    required = bool(os.environ.get("HYPIC_REQUIRE_BROWSER"))
    if not CHROMIUM.exists() and not required:
        pytest.skip("no /usr/bin/chromium (apt-get install chromium chromium-driver; .ci/run installs them and sets "
                    "HYPIC_REQUIRE_BROWSER=1, which makes this a failure instead)")
    return start_browser()


@contextlib.contextmanager
def start_browser():
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not fetch a driver or a browser
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="hypic-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """The page, as a user drives it."""

    def __init__(self, driver, url: str, timeout: float = 120) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.wait = WebDriverWait(driver, timeout)
        driver.get(url + "/")

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def type(self, css: str, text: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(text)

    def use_key(self, key: str) -> None:
        self.type("#key", key)
        self.find("#key-form button[type=submit]").click()
        self.wait.until(lambda d: self.find("#status").get_attribute("data-state") == "ready")
        self.wait.until(lambda d: "key in use" in self.find("#key-state").text)

    def finished(self, card: str) -> str:
        self.wait.until(lambda d: self.find(card).get_attribute("data-state") in ("done", "failed"))
        assert self.find(card).get_attribute("data-state") == "done", (self.find(card).text, self.find("#error").text)
        return self.find(card + " .answer").text

    def ask(self, question: str, top_k: int = 3, mode: str = "hypic", max_tokens: int = 64) -> str:
        from selenium.webdriver.support.ui import Select

        self.type("#question", question)
        self.type("#top-k", str(top_k))
        self.type("#max-tokens", str(max_tokens))
        Select(self.find("#mode")).select_by_value(mode)
        self.find("#ask").click()
        self.wait.until(lambda d: self.find("#run-main").get_attribute("data-state") in ("streaming", "done", "failed"))
        return self.finished("#run-main")

    def chunks(self, card: str) -> list[dict]:
        return [{"chunk_id": row.get_attribute("data-chunk"), "how": row.get_attribute("data-how"),
                 "reused": int(row.find_element("css selector", ".reused-n").text),
                 "seam": int(row.find_element("css selector", ".seam-n").text),
                 "computed": int(row.find_element("css selector", ".computed-n").text)} for row in self.all(card + " tr.chunk")]

    def sources(self) -> list[str]:
        return [li.get_attribute("data-document") for li in self.all("#sources li.source")]


def test_the_page_in_a_browser(server, client):
    with browser_or_skip() as driver:
        page = Page(driver, server.url)
        page.wait.until(lambda d: "needs an API key" in page.find("#key-state").text)  # /v1/models refused without it
        page.use_key(KEY)
        assert "hypic-tiny" in page.find("#status").text
        page.wait.until(lambda d: page.all("#doc-list li.doc"))  # the documents, listed with the key

        question = "In which city is Seinaim based?"  # no other test here asks about companies: its chunks are cold
        first = page.ask(question)
        expected = ask(client, question=question, top_k=3, mode="hypic")  # the API's answer to the same request (warm)
        assert first.strip() == expected["answer"].strip() and first.strip()
        assert page.sources() == [s["document_id"] for s in expected["sources"]] and "company-seinaim" in page.sources()
        assert {c["how"] for c in page.chunks("#run-main")} == {"computed"}  # the page asked first: nothing cached yet
        assert page.find("#run-main .ttft dd").text.endswith("ms") or page.find("#run-main .ttft dd").text.endswith(" s")

        again = page.ask(question)
        assert again == first
        shown = page.chunks("#run-main")
        api = ask(client, question=question, top_k=3, mode="hypic")["reuse"]
        assert shown == [{k: r[k] for k in ("chunk_id", "how", "reused", "seam", "computed")} for r in api]
        assert {c["how"] for c in shown} == {"composed"} and all(c["reused"] > 0 and c["seam"] > 0 for c in shown)
        assert "composed_tokens" in page.find("#run-main .legend").text

        page.find("#compare").click()
        full = page.finished("#run-full")
        assert full.strip()
        assert {c["how"] for c in page.chunks("#run-full")} == {"computed"}
        assert all(c["reused"] == 0 and c["seam"] == 0 for c in page.chunks("#run-full"))
        page.wait.until(lambda d: page.find("#verdict").is_displayed())
        assert "full" in page.find("#verdict").text and "First token" in page.find("#verdict").text

        page.type("#doc-id", UPLOAD["id"])
        page.type("#doc-title", UPLOAD["title"])
        page.type("#doc-text", UPLOAD["text"])
        page.find("#doc-add").click()
        page.wait.until(lambda d: page.all(f'#doc-list li.new[data-document="{UPLOAD["id"]}"]'))
        assert "Added quorvath-lighthouse" in page.find("#doc-state").text
        assert client.get(f"/documents/{UPLOAD['id']}").status_code == 200

        page.ask("Who is the keeper of the Quorvath lighthouse?")
        assert page.sources()[0] == UPLOAD["id"]
        assert UPLOAD["title"] in page.find("#sources li.source").text
        assert not page.find("#error").is_displayed()


def test_the_page_without_a_key_asks_and_uploads_a_file(tiny_tokenizer, tmp_path):
    """A gateway without a key (the default): no key asked for; the page's writes pass the Origin
    check (same origin), a file goes up as multipart and is listed."""
    import gateways

    corpus = [{"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]
    with gateways.gateway(tmp_path / "gw", tiny_tokenizer, corpus) as live, browser_or_skip() as driver:
        page = Page(driver, live.url)
        page.wait.until(lambda d: page.find("#status").get_attribute("data-state") == "ready")
        assert page.find("#key-state").text == ""
        page.ask("Who is the mayor of Varo?", top_k=1)
        assert page.sources() == ["city-varo"] and len(page.chunks("#run-main")) == 1
        notes = tmp_path / "alna-notes.md"
        notes.write_text("# Alna notes\n\nThe Alna freezes every winter near Varo.\n")
        page.find("#doc-file").send_keys(str(notes))
        page.find("#doc-add").click()
        page.wait.until(lambda d: page.find("#doc-state").text not in ("", "Adding…"))
        assert page.find("#doc-state").text.startswith("Added alna-notes.md: 1 chunk"), page.find("#doc-state").text
        page.wait.until(lambda d: page.all('#doc-list li.new[data-document="alna-notes.md"]'))
        assert "Alna notes" in page.find('#doc-list li.new[data-document="alna-notes.md"]').text
        assert httpx.get(f"{live.url}/documents/alna-notes.md").json()["title"] == "Alna notes"


# --- the screenshot ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Serve `--model` (default: the bundled hypic-tiny on its demo corpus; with `--documents PATH...`,
    those instead), warm it up, ask `--question` on the page, compare with full, and save the page as
    `--out` (PNG)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="hypic-tiny")
    parser.add_argument("--documents", nargs="*", type=Path, help="ingested instead of the demo corpus")
    parser.add_argument("--question", default="Who is the mayor of Bajend?")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="API requests in each mode (hypic, full) before the page asks: "
                        "the first ones of a fresh process are slow, and the question's chunks are then cached")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "page.png")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)]
    from app.http.server import create_app
    from app.testing import LiveServer, single_torch_thread

    with tempfile.TemporaryDirectory() as tmp:
        corpus = None
        if args.documents:
            from retrieval.formats import read_documents

            corpus = Path(tmp) / "corpus.jsonl"
            docs = [d for p in args.documents for d in read_documents(p.read_bytes(), p.name, str(p), str(p))]
            corpus.write_text("".join(json.dumps({"id": d.document_id, "text": d.text, "title": d.title}) + "\n" for d in docs))
        # no shadow checks: the accuracy guard's extra work would land inside the timings shown
        settings = gateway_settings(Path(tmp), model=args.model, guard_sample_rate=0, **({"corpus": corpus} if corpus else {}))
        with single_torch_thread(), LiveServer(create_app(settings)) as live, start_browser() as driver:
            live.wait_ready(timeout=900, headers=AUTH)  # a real model loads and ingests for minutes on 2 busy cores
            page = Page(driver, live.url, timeout=600)
            for _ in range(args.warmup):
                for mode in ("hypic", "full"):
                    httpx.post(f"{live.url}/query", headers=AUTH, timeout=600,
                               json={"question": args.question, "top_k": args.top_k, "max_tokens": 1, "mode": mode}).raise_for_status()
            page.use_key(KEY)
            answer = page.ask(args.question, args.top_k, max_tokens=args.max_tokens)
            page.find("#compare").click()
            page.finished("#run-full")
            page.wait.until(lambda d: page.find("#verdict").is_displayed())
            height = driver.execute_script("return document.body.scrollHeight")
            driver.set_window_size(1280, min(height + 40, 2400))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
            print(f"{args.out}: {args.model}, {args.question!r} -> {answer!r}")


if __name__ == "__main__":
    main()
