"""Serving load benchmark: open-loop arrivals against the gateway, every mode side by side.

In the spirit of `vllm bench serve`: a client sends streaming POST /v1/completions requests at
Poisson arrival times (or all at once) and measures, per request, time to first token (TTFT),
inter-token latencies (ITL, between streamed content chunks), time per output token (TPOT),
end-to-end latency (E2E) and output tokens (from `usage`, `stream_options.include_usage`).
Queue time (`hypic_queue_seconds`; without it, server TTFT minus prefill), prefill time and
cache hit rates by tier come from the gateway's GET /metrics, read before and after each run
(deltas); its running / waiting gauges are sampled during the run. Each mode (full, prefix,
pic-naive, hypic) gets a fresh gateway subprocess, so the modes' caches are independent;
`--restart cell` also restarts it for every rate. A run of one mode at one rate is a "cell".

Workload (RAG): a corpus of `--corpus-size` chunks of about `--chunk-tokens` tokens (random
words the tokenizer knows, lengths measured with the tokenizer). A request's segments are a
system prompt common to all requests (so `prefix` has something to reuse) and `--k` chunks
drawn without replacement with Zipf(`--zipf`) popularity, then shuffled; its prompt is a short
random question. `--cold` makes every chunk new (never repeats). The same `--seed` gives the
same requests and arrival times in every mode. `--warmup N` requests are sent one at a time
before the first cell of each gateway (they fill its caches and warm its kernels); with one
gateway per mode, rate i measures the i-th slice of one request stream, so no cell replays
requests an earlier cell already cached.

The sustainable rate of a mode is the largest tested rate whose p95 TTFT is under
`--slo-ttft-ms` with no failed request; `--search` finds it per mode instead of reading it off
the grid (from `--search-start`, doubling or halving until the SLO is met at one rate and missed
at the next, then bisecting that bracket to `--search-tolerance`; each probe is a fresh slice of
`--num-requests` requests on the mode's one gateway). `--decode-scaling` also measures decode throughput with
1 and 8 concurrent streams (mode hypic, warm, `--decode-tokens` tokens each, ignore_eos).
`--cold-arrival` measures running streams' inter-token latency while a cold `--k`-chunk request
prefills, for each `--arrival-step-tokens` budget (chunked prefill against none).

Run (small: a few minutes on 2 CPU cores):
    .venv/bin/python bench/make_bench_model.py /tmp/bench-model-small --layers 4 --hidden 256
    .venv/bin/python bench/serve.py --model /tmp/bench-model-small --rates 1 --num-requests 8 \\
        --chunk-tokens 64 --k 4 --corpus-size 40 --warmup 4 --max-tokens 16 \\
        --out /tmp/serve.json --plot /tmp/serve.png

Full (10 x 512-token chunks of 200, Zipf 1.1; writes docs/benchmarks.md's serve section and
docs/serve_ttft_vs_rate.png). On 2 CPU cores a 5k-token `full` prefill of the 31M bench model
takes ~5 s, so keep the rates low there (about an hour in all):
    .venv/bin/python bench/make_bench_model.py /tmp/bench-model
    .venv/bin/python bench/serve.py --model /tmp/bench-model --rates 0.1 0.2 0.4 0.8 --num-requests 40 \\
        --duration 200 --warmup 40 --slo-ttft-ms 5000 --decode-scaling \\
        --out /tmp/serve_results.json --plot docs/serve_ttft_vs_rate.png --markdown
On a GPU: bench/gpu.sh OUTDIR (install, bench model, rates 2 4 8, decode scaling; < 8 minutes).

Against a gateway already running (its caches carry over between cells and modes; the
tokenizer for sizing texts comes from --model):
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --model /tmp/bench-model --rates 1 2

Managed gateways run `python -m app.cli serve` on 127.0.0.1 with HYPIC_MODEL=--model,
HYPIC_CORPUS_PATH=none, HYPIC_EMBEDDER=hashing, a temporary HYPIC_INDEX_DIR, HYPIC_MAX_RUNNING /
HYPIC_MAX_QUEUE from the options; every other HYPIC_* variable of the environment (HYPIC_DEVICE,
HYPIC_TORCH_THREADS, HYPIC_CACHE_*...) passes through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import httpx
import numpy as np

from markdown_section import write_section  # bench/ is the script directory

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "prefix", "pic-naive", "hypic")
ROUTE = "/v1/completions"
BURST = math.inf
# Used only when the tokenizer knows fewer whole words than this list.
FALLBACK_WORDS = (
    "river city company founded mayor museum harbour bridge market station school garden library tower castle "
    "valley forest island mountain village street square theatre factory railway canal festival council "
    "painter pilot gardener merchant baker teacher doctor sailor farmer miller weaver engineer writer "
    "north south east west old new great small early late first last many several famous quiet busy"
).split()

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------
class TextMaker:
    """Random English-ish text of about a given token length, over whole words of a tokenizer."""

    def __init__(self, tokenizer_file: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        words = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                 if not t.special and t.content.isalpha()}
        for piece in self.tokenizer.get_vocab(with_added_tokens=False):
            if piece[:1] in ("Ġ", "▁") and piece[1:].isalpha() and len(piece) > 2:
                words.add(piece[1:])
        if len(words) < len(FALLBACK_WORDS):
            words.update(FALLBACK_WORDS)
        self.words = np.array(sorted(words))

    def count(self, text: str) -> int:
        """Tokens of `text` as the gateway encodes a segment (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, n_tokens: int, rng: np.random.Generator, prefix: str = "", suffix: str = "") -> str:
        """`prefix` + random words + `suffix`, at most `n_tokens` tokens and within a word of it."""
        words: list[str] = []

        def render() -> str:
            return prefix + " ".join(words) + suffix

        while (have := self.count(render())) < n_tokens:
            words += rng.choice(self.words, size=max(1, (n_tokens - have) // 2)).tolist()
        while len(words) > 1 and self.count(render()) > n_tokens:
            words.pop()
        return render()


@dataclass(frozen=True)
class Item:
    """One request of the workload: the system prompt and chunks (segments) and the question (prompt)."""

    segments: tuple[str, ...]
    prompt: str
    chunk_ids: tuple[int, ...]


@dataclass
class Workload:
    system: str
    warmup: list[Item]
    measured: list[Item]  # `slices` consecutive slices of `num_requests`
    num_requests: int
    tokens: dict[str, float]  # mean measured tokens: system, chunk, question, prompt

    def slice(self, i: int) -> list[Item]:
        return self.measured[i * self.num_requests:(i + 1) * self.num_requests]


def build_workload(args: argparse.Namespace, maker: TextMaker, slices: int) -> Workload:
    """The same requests for a given seed whatever the mode; warm-up and measured requests come
    from separate random streams, so `--warmup` does not change the measured requests."""
    if not args.cold and args.k > args.corpus_size:
        raise SystemExit(f"--k {args.k} exceeds --corpus-size {args.corpus_size}")
    base = np.random.default_rng([args.seed, 0])
    system = maker.text(args.system_tokens, base, "Answer the question using only the documents. ", "\n")
    corpus = [] if args.cold else [maker.text(args.chunk_tokens, base, "Document: ", ".\n")
                                   for _ in range(args.corpus_size)]
    popularity = 1.0 / np.arange(1, args.corpus_size + 1) ** args.zipf
    popularity /= popularity.sum()
    cold_ids = iter(range(10**9))

    def draw(rng: np.random.Generator) -> Item:
        if args.cold:
            ids = [next(cold_ids) for _ in range(args.k)]
            chunks = [maker.text(args.chunk_tokens, rng, "Document: ", ".\n") for _ in ids]
        else:
            ids = rng.choice(args.corpus_size, size=args.k, replace=False, p=popularity).tolist()
            rng.shuffle(ids)
            chunks = [corpus[i] for i in ids]
        question = maker.text(args.question_tokens, rng, "Question: ", "?\nAnswer:")
        return Item((system, *chunks), question, tuple(ids))

    warm_rng, measured_rng = np.random.default_rng([args.seed, 1]), np.random.default_rng([args.seed, 2])
    warmup = [draw(warm_rng) for _ in range(args.warmup)]
    measured = [draw(measured_rng) for _ in range(args.num_requests * slices)]
    sample = measured[: min(len(measured), 50)]
    chunk_tokens = [maker.count(c) for it in sample for c in it.segments[1:]]
    question_tokens = [maker.count(it.prompt) for it in sample]
    tokens = {"system": maker.count(system), "chunk": float(np.mean(chunk_tokens)),
              "question": float(np.mean(question_tokens))}
    tokens["prompt"] = tokens["system"] + args.k * tokens["chunk"] + tokens["question"]
    return Workload(system, warmup, measured, args.num_requests, tokens)


def arrival_times(n: int, rate: float, seed: int, duration: float) -> list[float]:
    """Seconds after the start of a cell at which each request is sent: Poisson at `rate` (the
    same times for every mode), all at 0 for a burst; only those before `duration`."""
    if rate == BURST:
        return [0.0] * n
    rng = np.random.default_rng([seed, 3, int(round(rate * 1000))])
    gaps = rng.exponential(1.0 / rate, size=n)
    times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return [float(t) for t in times if t < duration]


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One request as the client saw it. Times are `time.perf_counter()` values."""

    ok: bool
    error: str | None
    start: float
    end: float
    first_token: float | None = None
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of every chunk with text
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""  # the streamed completion

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)


class Client:
    def __init__(self, base: str, http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> None:
        self.base = base.rstrip("/")
        self.http = http
        self.model = model
        self.args = args

    def body(self, item: Item, mode: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": item.prompt, "segments": list(item.segments), "mode": mode,
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        }
        if self.args.seam is not None:
            body["seam"] = self.args.seam
        return body

    async def send(self, body: dict[str, Any]) -> Outcome:
        """POST one streaming completion; TTFT at the first chunk with text, ITL between such chunks."""
        start = time.perf_counter()
        out = Outcome(ok=False, error=None, start=start, end=start)
        last: float | None = None
        done = False
        try:
            async with self.http.stream("POST", self.base + ROUTE, json=body) as response:
                if response.status_code != 200:
                    out.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                    out.end = time.perf_counter()
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    payload = json.loads(data)
                    if "error" in payload:
                        out.error = "stream error: " + str(payload["error"].get("message", payload["error"]))[:200]
                    for choice in payload.get("choices") or ():
                        if choice.get("text"):
                            out.text += choice["text"]
                            now = time.perf_counter()
                            out.token_times.append(now)
                            if last is None:
                                out.first_token = now
                            else:
                                out.itl.append(now - last)
                            last = now
                    if usage := payload.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (httpx.HTTPError, ValueError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:200]
        out.end = time.perf_counter()
        if out.error is None and not done:
            out.error = "stream ended without [DONE]"
        out.ok = out.error is None
        return out

    async def metrics(self) -> Sample:
        response = await self.http.get(self.base + "/metrics")
        response.raise_for_status()
        return parse_prometheus(response.text)


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body (else the body), shortened."""
    try:
        return str(json.loads(body)["error"]["message"])[:120]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:120]


# --------------------------------------------------------------------------------------------
# Prometheus text
# --------------------------------------------------------------------------------------------
_SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> Sample:
    out: Sample = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not (m := _SERIES.match(line)):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def subtract(after: Sample, before: Sample) -> Sample:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(sample: Sample, name: str, **labels: str) -> float:
    """Sum of the series `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in sample.items() if n == name and want <= set(ls))


def label_values(sample: Sample, name: str, label: str) -> list[str]:
    return sorted({dict(ls)[label] for (n, ls) in sample if n == name and label in dict(ls)})


def hist_mean(sample: Sample, name: str, **labels: str) -> float | None:
    count = total(sample, name + "_count", **labels)
    return total(sample, name + "_sum", **labels) / count if count else None


def server_summary(d: Sample, k: int, mode: str) -> dict[str, Any]:
    """What the gateway's counters say about one cell (`d`: after - before)."""
    seg_hit = total(d, "hypic_segment_lookups_total", result="hit")
    seg_miss = total(d, "hypic_segment_lookups_total", result="miss")
    lookups = seg_hit + seg_miss
    tiers = {t: total(d, "hypic_cache_hits_total", tier=t) for t in label_values(d, "hypic_cache_hits_total", "tier")}
    store_lookups = sum(tiers.values()) + total(d, "hypic_cache_misses_total")
    # The segment store holds chunks only: the system prompt is an exact prefix (exact snapshots).
    chunk_hit = sum(tiers.values()) / store_lookups if store_lookups else None
    queue_names = sorted({n[:-4] for (n, _) in d if re.fullmatch(r"hypic_\w*queue\w*_seconds_sum", n)})
    prefill = hist_mean(d, "hypic_prefill_seconds", mode=mode)
    ttft = hist_mean(d, "hypic_time_to_first_token_seconds", route=ROUTE)
    tokens = {kind: total(d, "hypic_prompt_tokens_total", kind=kind) for kind in ("exact", "composed", "seam", "fresh")}
    prompt = sum(tokens.values())  # the kinds partition the prompt
    return {
        "segment_lookups": lookups,
        "segment_hit_rate": seg_hit / lookups if lookups else None,
        "chunk_hit_rate": chunk_hit,
        "store_lookups": store_lookups,
        "store_hit_rate_by_tier": {t: v / store_lookups for t, v in tiers.items()} if store_lookups else {},
        "prompt_tokens": tokens,
        "reused_fraction": (tokens["exact"] + tokens["composed"]) / prompt if prompt else None,
        "prefill_ms": _ms(prefill),
        "server_ttft_ms": _ms(ttft),
        "queue_metric": queue_names[0] if queue_names else None,
        "queue_ms": _ms(hist_mean(d, queue_names[0])) if queue_names else None,
        # Without a queue-time metric: arrival -> first token minus prefill, per request on average.
        "wait_ms": _ms(ttft - prefill) if ttft is not None and prefill is not None else None,
        "rejected": total(d, "hypic_requests_rejected_total"),
        "generated_tokens": total(d, "hypic_generated_tokens_total"),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# --------------------------------------------------------------------------------------------
# Gateway subprocess
# --------------------------------------------------------------------------------------------
def terminate(proc: subprocess.Popen | None, grace: float = 20.0) -> None:
    """Stop a server process: SIGTERM, then SIGKILL after `grace` seconds; None or exited is a no-op."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Gateway:
    """A gateway subprocess on 127.0.0.1 with fresh caches, empty index, and the bench model."""

    live: set["Gateway"] = set()  # started and not yet stopped (stopped on any exit of main)

    def __init__(self, args: argparse.Namespace, label: str, max_running: int | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.args = args
        self.label = label
        self.extra_env = extra_env or {}
        self.max_running = max_running or args.max_running
        self.workdir = Path(tempfile.mkdtemp(prefix=f"hypic-serve-{label}-"))
        self.log = self.workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.base = ""

    def env(self, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "HYPIC_MODEL": str(self.args.model), "HYPIC_HOST": "127.0.0.1", "HYPIC_PORT": str(port),
            "HYPIC_CORPUS_PATH": "none", "HYPIC_INDEX_DIR": str(self.workdir / "index"), "HYPIC_EMBEDDER": "hashing",
            "HYPIC_MAX_RUNNING": str(self.max_running), "HYPIC_MAX_QUEUE": str(self.args.max_queue),
            "HYPIC_MAX_NEW_TOKENS": str(max(1024, self.args.max_tokens, self.args.decode_tokens)),
            "HYPIC_API_KEY": "none", "HYPIC_LOG_LEVEL": "warning", "TOKENIZERS_PARALLELISM": "false",
        })
        if self.args.torch_threads is not None:
            env["HYPIC_TORCH_THREADS"] = str(self.args.torch_threads)
        env.update(self.extra_env)
        return env

    async def start(self, http: httpx.AsyncClient) -> str:
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=self.env(port),
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        Gateway.live.add(self)
        proc = self.proc
        def dead() -> str | None:
            return None if proc.poll() is None else f"exited with status {proc.returncode} while loading"

        problem = await wait_ready(http, self.base, self.args.startup_timeout, dead)
        if problem:
            self.fail(problem)
        _progress(f"[{self.label}] gateway ready on {self.base} in {time.perf_counter() - started:.1f} s")
        return self.base

    def fail(self, reason: str) -> None:
        tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
        self.stop()
        raise SystemExit(f"gateway ({self.label}) {reason}; its log ends with:\n{tail}")

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None
        Gateway.live.discard(self)
        if not self.args.keep_logs:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def wait_ready(http: httpx.AsyncClient, base: str, timeout: float,
                     dead: Callable[[], str | None] = lambda: None) -> str | None:
    """Poll GET /ready until 200; the reason it never came (load failure, `dead()`, timeout), or None."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if reason := dead():
            return reason
        try:
            response = await http.get(base.rstrip("/") + "/ready")
            if response.status_code == 200:
                return None
            if response.json().get("status") == "failed":
                return f"loading failed: {response.json().get('error')}"
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return f"not ready after {timeout:.0f} s"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def served_model(http: httpx.AsyncClient, base: str) -> str:
    response = await http.get(base.rstrip("/") + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
async def watch_gauges(client: Client, stop: asyncio.Event, interval: float = 0.25) -> dict[str, float]:
    """Peak and mean of the gateway's running / waiting gauges while a cell runs, sampled every `interval` s."""
    running: list[float] = []
    waiting: list[float] = []
    while not stop.is_set():
        try:
            m = await client.metrics()
            running.append(total(m, "hypic_requests_running"))
            waiting.append(total(m, "hypic_requests_waiting"))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return {"max_running": max(running, default=0.0), "max_waiting": max(waiting, default=0.0),
            "mean_waiting": float(np.mean(waiting)) if waiting else 0.0}


async def warm(client: Client, items: Sequence[Item], mode: str, label: str) -> None:
    """Send `items` one at a time (fills the caches, warms kernels); failures abort the run."""
    for i, item in enumerate(items):
        out = await client.send(client.body(item, mode, client.args.max_tokens))
        if not out.ok:
            raise SystemExit(f"[{label}] warm-up request {i + 1} failed: {out.error}")
    if items:
        _progress(f"[{label}] warm-up: {len(items)} requests sent one at a time")


async def run_cell(client: Client, items: Sequence[Item], times: Sequence[float],
                   mode: str) -> tuple[list[Outcome], float, Sample, dict]:
    """Send `items[i]` at `times[i]` (open loop) and wait for every response.
    Returns the outcomes, the cell's duration (first send to last response), the metrics delta and the gauges."""
    before = await client.metrics()
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_gauges(client, stop))
    t0 = time.perf_counter()
    tasks = []
    for item, at in zip(items, times):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.send(client.body(item, mode, client.args.max_tokens))))
    outcomes = list(await asyncio.gather(*tasks))
    duration = max(o.end for o in outcomes) - t0 if outcomes else 0.0
    stop.set()
    gauges = await watcher
    after = await client.metrics()
    return outcomes, duration, subtract(after, before), gauges


def dist_ms(values: Iterable[float | None]) -> dict[str, float | None]:
    v = np.array([x for x in values if x is not None], dtype=float) * 1000.0
    if not v.size:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)),
            "p99": float(np.percentile(v, 99))}


def summarize(mode: str, rate: float, outcomes: list[Outcome], duration: float, delta: Sample, gauges: dict,
              k: int, reuse: float | None) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    failures: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            failures[o.error or "?"] = failures.get(o.error or "?", 0) + 1
    output = sum(o.output_tokens for o in good)
    return {
        "mode": mode, "rate": None if rate == BURST else rate, "label": rate_label(rate),
        "sent": len(outcomes), "completed": len(good), "failed": len(outcomes) - len(good), "failures": failures,
        "duration_s": duration,
        "request_throughput": len(good) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "output_tokens": output,
        "mean_prompt_tokens": float(np.mean([o.prompt_tokens for o in good])) if good else None,
        "mean_cached_tokens": float(np.mean([o.cached_tokens for o in good])) if good else None,
        "ttft_ms": dist_ms(o.ttft for o in good),
        "itl_ms": dist_ms(x for o in good for x in o.itl),
        "tpot_ms": dist_ms(o.tpot for o in good),
        "e2e_ms": dist_ms(o.e2e for o in good),
        "client_chunk_reuse": reuse,
        "gauges": gauges,
        "server": server_summary(delta, k, mode),
        "requests": [{"ok": o.ok, "error": o.error, "sent_s": o.start - outcomes[0].start, "ttft_ms": _ms(o.ttft),
                      "e2e_ms": o.e2e * 1000.0, "output_tokens": o.output_tokens, "prompt_tokens": o.prompt_tokens,
                      "cached_tokens": o.cached_tokens} for o in outcomes],
    }


def rate_label(rate: float) -> str:
    return "burst" if rate == BURST else f"{rate:g} req/s"


class ReuseTracker:
    """Client-side ideal chunk hit rate: the fraction of chunk occurrences this gateway has seen before."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def feed(self, items: Iterable[Item]) -> float | None:
        hits = n = 0
        for item in items:
            for c in item.chunk_ids:
                hits += c in self.seen
                n += 1
                self.seen.add(c)
        return hits / n if n else None


async def run_load(args: argparse.Namespace, http: httpx.AsyncClient, workload: Workload, rates: list[float],
                   checkpoint: Callable[[list[dict]], None]) -> list[dict]:
    """Every cell, mode by mode; `checkpoint(cells)` after each, so an interrupted run leaves its results."""
    cells: list[dict] = []
    for mode in args.modes:
        gateway: Gateway | None = None
        client: Client | None = None
        tracker = ReuseTracker()
        try:
            for i, rate in enumerate(rates):
                label = f"{mode} @ {rate_label(rate)}"
                if client is None or args.restart == "cell":
                    if gateway is not None:
                        gateway.stop()
                    tracker = ReuseTracker()
                    if args.url:
                        base = args.url
                    else:
                        gateway = Gateway(args, mode)
                        base = await gateway.start(http)
                    client = Client(base, http, args.model_name or await served_model(http, base), args)
                    tracker.feed(workload.warmup)
                    await warm(client, workload.warmup, mode, label)
                items = workload.slice(0 if args.restart == "cell" else i)
                times = arrival_times(len(items), rate, args.seed, args.duration)
                items = items[:len(times)]
                reuse = tracker.feed(items)
                outcomes, duration, delta, gauges = await run_cell(client, items, times, mode)
                cell = summarize(mode, rate, outcomes, duration, delta, gauges, args.k, reuse)
                cells.append(cell)
                _progress(cell_line(cell))
                checkpoint(cells)
        finally:
            if gateway is not None:
                gateway.stop()
    return cells


class OutOfProbes(Exception):
    """The rate search used every slice of the request stream it was given."""


def meets_slo(cell: dict, slo_ms: float) -> bool:
    """No failed request and p95 TTFT under `slo_ms`."""
    p95 = cell["ttft_ms"]["p95"]
    return cell["failed"] == 0 and bool(cell["completed"]) and p95 is not None and p95 < slo_ms


async def search_rates(args: argparse.Namespace, http: httpx.AsyncClient, workload: Workload,
                       checkpoint: Callable[[dict], None]) -> dict[str, dict]:
    """Per mode, the highest Poisson rate whose p95 TTFT meets the SLO, found by search: from
    `--search-start`, double (or halve) until one probe meets it and the next does not, then
    bisect that bracket until it is within `--search-tolerance` (relative). Each probe is a
    cell on the mode's one gateway (caches carry over, as with `--restart mode`) and sends the
    next unused slice of the request stream. Returns {mode: {"rate", "bracket", "probes"}}."""
    found: dict[str, dict] = {}
    for mode in args.modes:
        gateway = None if args.url else Gateway(args, f"{mode}-search")
        try:
            base = args.url or await gateway.start(http)  # type: ignore[union-attr]
            client = Client(base, http, args.model_name or await served_model(http, base), args)
            await warm(client, workload.warmup, mode, f"{mode} search")
            probes: list[dict] = []
            used = iter(range(args.search_probes))

            async def probe(rate: float) -> bool:
                i = next(used, None)
                if i is None:
                    raise OutOfProbes
                items = workload.slice(i)
                times = arrival_times(len(items), rate, args.seed, args.duration)
                outcomes, duration, delta, gauges = await run_cell(client, items[:len(times)], times, mode)
                cell = summarize(mode, rate, outcomes, duration, delta, gauges, args.k, None)
                ok = meets_slo(cell, args.slo_ttft_ms)
                probes.append({"rate": rate, "ok": ok, "ttft_ms": cell["ttft_ms"], "failed": cell["failed"],
                               "failures": cell["failures"], "completed": cell["completed"]})
                _progress(f"[{mode} search] {rate:.3g} req/s: p95 TTFT {_f(cell['ttft_ms']['p95'])} ms, "
                          f"{cell['failed']} failed{_failure_kinds(cell['failures'])} -> "
                          f"{'meets' if ok else 'misses'} the SLO")
                checkpoint(found | {mode: {"rate": None, "bracket": None, "probes": probes, "partial": True}})
                return ok

            lo: float | None = None  # highest rate seen meeting the SLO
            hi: float | None = None  # lowest rate seen missing it
            rate = args.search_start
            try:
                while lo is None or hi is None:  # bracket
                    if await probe(rate):
                        lo = rate
                        rate *= 2
                    else:
                        hi = rate
                        rate /= 2
                    if rate > args.search_max or rate < args.search_min:
                        break
                while lo is not None and hi is not None and hi / lo > 1 + args.search_tolerance:  # bisect (geometric)
                    mid = math.sqrt(lo * hi)
                    if await probe(mid):
                        lo = mid
                    else:
                        hi = mid
            except OutOfProbes:
                _progress(f"[{mode} search] out of probes ({args.search_probes}); keeping the bracket so far")
            found[mode] = {"rate": lo, "bracket": [lo, hi], "probes": probes}
        finally:
            if gateway is not None:
                gateway.stop()
    return found


def search_table(found: dict[str, dict], slo_ms: float) -> str:
    """A row per mode: the rate found, its bracket, the probes, and the ratios to full and prefix."""
    header = ["mode", f"sustainable rate (p95 TTFT < {slo_ms:g} ms)", "bracket (meets / misses)", "probes: rate -> p95 TTFT (ms)",
              "vs full / prefix"]
    rows = []
    for mode in [m for m in MODES if m in found]:
        f = found[mode]
        lo, hi = f["bracket"] or (None, None)
        probes = ", ".join(f"{p['rate']:.3g} -> {_f(p['ttft_ms']['p95'])}{'' if p['ok'] else ' (x)'}" for p in f["probes"])
        ratios = " / ".join((f"{f['rate'] / found[b]['rate']:.2f}x" if f["rate"] and (found.get(b) or {}).get("rate") else "-")
                            for b in ("full", "prefix"))
        rows.append([mode, f"{f['rate']:.3g} req/s" if f["rate"] else "none found",
                     f"{_f(lo, '{:.3g}')} / {_f(hi, '{:.3g}')}", probes, ratios])
    return table(header, rows)


async def decode_scaling(args: argparse.Namespace, http: httpx.AsyncClient, maker: TextMaker, workload: Workload) -> dict:
    """Decode throughput with 1 and with 8 concurrent streams: mode hypic, warm caches, same context."""
    gateway = None if args.url else Gateway(args, "decode", max_running=max(args.max_running, 8))
    try:
        base = args.url or await gateway.start(http)  # type: ignore[union-attr]
        client = Client(base, http, args.model_name or await served_model(http, base), args)
        rng = np.random.default_rng([args.seed, 4])
        context = workload.warmup[0].segments if workload.warmup else workload.measured[0].segments
        questions = [maker.text(args.question_tokens, rng, "Question: ", "?\nAnswer:") for _ in range(8)]

        def body(q: str) -> dict:
            return client.body(Item(context, q, ()), "hypic", args.decode_tokens)

        for q in questions[:2]:  # fill the segment cache, warm the kernels
            out = await client.send(body(q))
            if not out.ok:
                raise SystemExit(f"[decode] warm-up failed: {out.error}")
        result: dict[str, Any] = {"decode_tokens": args.decode_tokens, "reps": args.decode_reps}
        for streams in (1, 8):
            runs = []
            for _ in range(args.decode_reps):
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(client.send(body(q)) for q in questions[:streams]))
                failed = [o.error for o in outs if not o.ok]
                if failed:
                    raise SystemExit(f"[decode] {len(failed)} of {streams} streams failed: {failed[0]}")
                wall = max(o.end for o in outs) - t0
                tokens = sum(o.output_tokens for o in outs)
                runs.append({"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                             "tpot_ms": float(np.mean([o.tpot for o in outs if o.tpot is not None])) * 1000.0,
                             "ttft_ms": float(np.mean([o.ttft for o in outs if o.ttft is not None])) * 1000.0})
            best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
            result[f"streams_{streams}"] = best | {"runs": runs}
            _progress(f"[decode] {streams} stream(s): {best['tokens_per_s']:.1f} tok/s "
                      f"(mean TPOT {best['tpot_ms']:.1f} ms, {best['tokens']} tokens in {best['wall_s']:.2f} s)")
        result["ratio"] = result["streams_8"]["tokens_per_s"] / result["streams_1"]["tokens_per_s"]
        _progress(f"[decode] 8 streams / 1 stream: {result['ratio']:.2f}x")
        return result
    finally:
        if gateway is not None:
            gateway.stop()


async def cold_arrival(args: argparse.Namespace, http: httpx.AsyncClient, maker: TextMaker) -> dict:
    """Inter-token latency of running streams while a cold request arrives, per step budget.

    For each `--arrival-step-tokens` value (HYPIC_MAX_STEP_TOKENS) a fresh gateway first times a
    `full` prefill of exactly that many tokens alone (the budget's prefill time, median of 3), then
    starts `--arrival-streams` streams (mode hypic, warm, long outputs) and, once they are decoding,
    sends one request of `--k` new chunks (mode hypic, cold). Reported: the running streams' gaps
    between tokens that overlap the cold request's prefill (its arrival to its first token).
    """
    rng = np.random.default_rng([args.seed, 5])
    system = maker.text(args.system_tokens, rng, "Answer the question using only the documents. ", "\n")
    warm_chunks = [maker.text(args.chunk_tokens, rng, "Document: ", ".\n") for _ in range(2)]
    result: dict[str, Any] = {"streams": args.arrival_streams, "cold_chunks": args.k, "chunk_tokens": args.chunk_tokens,
                              "budgets": []}
    for budget in args.arrival_step_tokens:
        gateway = None if args.url else Gateway(args, f"arrival-{budget}", max_running=max(args.max_running, args.arrival_streams + 1),
                                                extra_env={"HYPIC_MAX_STEP_TOKENS": str(budget)})
        try:
            base = args.url or await gateway.start(http)  # type: ignore[union-attr]
            client = Client(base, http, args.model_name or await served_model(http, base), args)

            def question() -> str:
                return maker.text(args.question_tokens, rng, "Question: ", "?\nAnswer:")

            budget_ms = None  # a budget above the cold prompt: no chunking, nothing to compare with
            if budget < args.k * args.chunk_tokens:
                probe = []
                for _ in range(4):  # the first one warms the kernels
                    text = maker.text(budget, rng, "Document: ", ".")
                    out = await client.send(client.body(Item((), text, ()), "full", 1))
                    if not out.ok or out.ttft is None:
                        raise SystemExit(f"[arrival] budget probe failed: {out.error}")
                    probe.append(out.ttft)
                budget_ms = float(np.median(probe[1:])) * 1000.0
            warm = Item((system, *warm_chunks), question(), ())
            await client.send(client.body(warm, "hypic", 1))  # fill the segment cache
            running = [asyncio.create_task(client.send(client.body(Item(warm.segments, question(), ()), "hypic",
                                                                   args.arrival_tokens)))
                       for _ in range(args.arrival_streams)]
            await asyncio.sleep(args.arrival_delay)
            cold = Item((system, *(maker.text(args.chunk_tokens, rng, "Document: ", ".\n") for _ in range(args.k))),
                        question(), ())
            cold_out = await client.send(client.body(cold, "hypic", 1))
            outs = await asyncio.gather(*running)
            if not cold_out.ok or cold_out.first_token is None or any(not o.ok for o in outs):
                raise SystemExit(f"[arrival] a request failed: {cold_out.error or [o.error for o in outs if not o.ok]}")
            lo, hi = cold_out.start, cold_out.first_token
            gaps = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:]) if b > lo and a < hi]
            before = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:]) if b <= lo]
            if not gaps:
                raise SystemExit("[arrival] no running stream produced a token during the cold prefill; "
                                 "raise --arrival-tokens")
            row = {"step_tokens": budget, "budget_prefill_ms": budget_ms, "cold_ttft_ms": (hi - lo) * 1000.0,
                   "cold_prompt_tokens": cold_out.prompt_tokens, "gaps": len(gaps),
                   "itl_before_ms": dist_ms(before), "itl_during_ms": dist_ms(gaps),
                   "itl_max_during_ms": max(gaps) * 1000.0}
            row["p99_over_budget"] = row["itl_during_ms"]["p99"] / budget_ms if budget_ms else None
            result["budgets"].append(row)
            _progress(f"[arrival] step budget {budget}: budget prefill {_f(budget_ms)} ms; "
                      f"cold TTFT {row['cold_ttft_ms']:.0f} ms; running streams' ITL during it p50 "
                      f"{row['itl_during_ms']['p50']:.0f} / p99 {row['itl_during_ms']['p99']:.0f} / max "
                      f"{row['itl_max_during_ms']:.0f} ms (p99 / budget prefill: {_f(row['p99_over_budget'], '{:.2f}x')})")
        finally:
            if gateway is not None:
                gateway.stop()
    return result


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pct(x: float | None) -> str:
    return _f(None if x is None else 100.0 * x, "{:.0f}%")


def _dist(d: dict[str, float | None], fmt: str = "{:.0f}") -> str:
    return " / ".join(_f(d[q], fmt) for q in ("mean", "p50", "p95", "p99"))


def _ratio(base: float | None, x: float | None) -> str:
    return f"{base / x:.2f}x" if base and x else "-"


def cell_line(c: dict) -> str:
    s = c["server"]
    return (f"[{c['mode']} @ {c['label']}] {c['completed']}/{c['sent']} ok in {c['duration_s']:.1f} s: "
            f"TTFT p50 {_f(c['ttft_ms']['p50'])} ms p95 {_f(c['ttft_ms']['p95'])} ms, "
            f"ITL p50 {_f(c['itl_ms']['p50'], '{:.1f}')} ms, "
            f"{c['request_throughput']:.2f} req/s, {c['output_throughput']:.1f} tok/s, "
            f"chunk hits {_pct(s['chunk_hit_rate'])}" + (f", failures {c['failures']}" if c["failed"] else ""))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with aligned columns (readable as plain text too)."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *map(line, rows)])


def cell_table(cells: list[dict]) -> str:
    """One rate: a column per mode."""
    by_mode = {c["mode"]: c for c in cells}
    modes = [m for m in MODES if m in by_mode] + [m for m in by_mode if m not in MODES]
    ref = {b: by_mode.get(b) for b in ("full", "prefix")}

    def speedups(key: str, c: dict) -> str:
        return " / ".join(_ratio(ref[b][key]["p50"] if ref[b] else None, c[key]["p50"]) for b in ("full", "prefix"))

    def tiers(c: dict) -> str:
        return ", ".join(f"{t} {_pct(v)}" for t, v in c["server"]["store_hit_rate_by_tier"].items()) or "-"

    def wait(c: dict) -> str:
        s = c["server"]
        return _f(s["queue_ms"]) if s["queue_metric"] else _f(s["wait_ms"])

    rows = [
        ("completed / failed", lambda c: f"{c['completed']} / {c['failed']}" + _failure_kinds(c["failures"])),
        ("request throughput (req/s)", lambda c: f"{c['request_throughput']:.2f}"),
        ("output throughput (tok/s)", lambda c: f"{c['output_throughput']:.1f}"),
        ("TTFT mean / p50 / p95 / p99 (ms)", lambda c: _dist(c["ttft_ms"])),
        ("TTFT p50 speed-up vs full / prefix", lambda c: speedups("ttft_ms", c)),
        ("ITL mean / p50 / p95 / p99 (ms)", lambda c: _dist(c["itl_ms"], "{:.1f}")),
        ("TPOT mean (ms)", lambda c: _f(c["tpot_ms"]["mean"], "{:.1f}")),
        ("E2E mean / p50 / p95 / p99 (ms)", lambda c: _dist(c["e2e_ms"])),
        ("E2E p50 speed-up vs full / prefix", lambda c: speedups("e2e_ms", c)),
        ("server prefill mean (ms)", lambda c: _f(c["server"]["prefill_ms"])),
        ("queue wait mean (ms)" if any(c["server"]["queue_metric"] for c in cells)
         else "wait: server TTFT - prefill (ms)", wait),
        ("peak running / waiting (sampled)",
         lambda c: f"{c['gauges']['max_running']:.0f} / {c['gauges']['max_waiting']:.0f}"),
        ("segment hit rate (server)", lambda c: _pct(c["server"]["segment_hit_rate"])),
        ("chunk hit rate: server / ideal",
         lambda c: f"{_pct(c['server']['chunk_hit_rate'])} / {_pct(c['client_chunk_reuse'])}"),
        ("store hits by tier / lookups", tiers),
        ("prompt tokens reused", lambda c: _pct(c["server"]["reused_fraction"])),
    ]
    return table(["", *modes], [[name, *(fn(by_mode[m]) for m in modes)] for name, fn in rows])


def _failure_kinds(failures: dict[str, int]) -> str:
    """' (HTTP 429: 3, stream error: 1)': failures counted by the part of their message before ':'."""
    kinds: dict[str, int] = {}
    for error, n in failures.items():
        kind = error.split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + n
    return " (" + ", ".join(f"{k}: {n}" for k, n in kinds.items()) + ")" if kinds else ""


def steady_state_hit_rate(cells: list[dict]) -> float | None:
    """Chunk hit rate over every measured cell of hypic (else pic-naive), weighted by lookups."""
    for mode in ("hypic", "pic-naive"):
        group = [c["server"] for c in cells if c["mode"] == mode and c["server"]["chunk_hit_rate"] is not None]
        if lookups := sum(s["segment_lookups"] for s in group):
            return sum(s["chunk_hit_rate"] * s["segment_lookups"] for s in group) / lookups
    return None


def sustainable(cells: list[dict], slo_ms: float) -> dict[str, float | None]:
    """Per mode: the largest tested rate with p95 TTFT under `slo_ms` and no failure."""
    out: dict[str, float | None] = {}
    for c in cells:
        out.setdefault(c["mode"], None)
        p95 = c["ttft_ms"]["p95"]
        if c["rate"] is not None and c["failed"] == 0 and c["completed"] and p95 is not None and p95 < slo_ms:
            out[c["mode"]] = max(out[c["mode"]] or 0.0, c["rate"])
    return out


def summary_table(cells: list[dict], rates: list[float], slo_ms: float) -> str:
    """A row per mode: TTFT p50 / p95 at every rate, and the sustainable rate with its ratios."""
    sus = sustainable(cells, slo_ms)
    modes = [m for m in MODES if m in sus] + [m for m in sus if m not in MODES]
    header = ["mode", *(f"{rate_label(r)}: TTFT p50 / p95 (ms)" for r in rates),
              f"sustainable rate (p95 TTFT < {slo_ms:g} ms)", "vs full / prefix"]
    rows = []
    for m in modes:
        row = [m]
        for r in rates:
            c = next((c for c in cells if c["mode"] == m and c["label"] == rate_label(r)), None)
            row.append(f"{_f(c['ttft_ms']['p50'])} / {_f(c['ttft_ms']['p95'])}" if c else "-")
        rate = sus[m]
        row.append(f"{rate:g} req/s" if rate else "none tested")
        row.append(" / ".join((f"{rate / sus[b]:.2f}x" if rate and sus.get(b) else "-") for b in ("full", "prefix")))
        rows.append(row)
    return table(header, rows)


def decode_table(d: dict) -> str:
    rows = [[str(n), f"{d[f'streams_{n}']['tokens_per_s']:.1f}", f"{d[f'streams_{n}']['tpot_ms']:.1f}",
             f"{d[f'streams_{n}']['ttft_ms']:.0f}"] for n in (1, 8)]
    return table(["concurrent streams", "output tok/s", "mean TPOT (ms)", "mean TTFT (ms)"], rows) + (
        f"\n\n8 streams / 1 stream: {d['ratio']:.2f}x output tokens/s ({d['decode_tokens']} tokens per stream, "
        f"mode hypic, warm; median of {d['reps']}).")


def arrival_table(d: dict) -> str:
    rows = [[str(r["step_tokens"]), _f(r["budget_prefill_ms"]), f"{r['cold_ttft_ms']:.0f}",
             f"{r['itl_before_ms']['p50']:.0f}", f"{r['itl_during_ms']['p50']:.0f}", f"{r['itl_during_ms']['p99']:.0f}",
             f"{r['itl_max_during_ms']:.0f}", _f(r["p99_over_budget"], "{:.2f}x")] for r in d["budgets"]]
    return table(["step budget (tokens)", "budget prefill (ms)", "cold TTFT (ms)", "ITL p50 before (ms)",
                  "ITL p50 during (ms)", "ITL p99 during (ms)", "ITL max during (ms)", "p99 / budget prefill"], rows) + (
        f"\n\n{d['streams']} running streams (mode hypic, warm) while one cold request of {d['cold_chunks']} new "
        f"~{d['chunk_tokens']}-token chunks (mode hypic) prefills; 'during' = gaps between their tokens that overlap "
        "the time from the cold request's arrival to its first token.")


def plot(cells: list[dict], rates: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    finite = [r for r in rates if r != BURST]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for mode in dict.fromkeys(c["mode"] for c in cells):
        points = [(c["rate"], c["ttft_ms"]["p50"]) for c in cells
                  if c["mode"] == mode and c["rate"] is not None and c["ttft_ms"]["p50"] is not None]
        if points:
            color = f"C{MODES.index(mode)}" if mode in MODES else None  # the same colour for a mode in every plot
            ax.plot(*zip(*sorted(points)), "o-", label=mode, color=color)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("p50 TTFT (ms)")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    if finite and max(finite) / min(finite) > 8:
        ax.set_xscale("log")  # doubling rates: evenly spaced
    if finite:
        ax.set_xticks(finite)
        ax.set_xticklabels([f"{r:g}" for r in finite])
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_info(path: Path) -> dict[str, Any]:
    """Architecture and parameter count from config.json and the safetensors headers (no torch)."""
    info: dict[str, Any] = {"path": str(path)}
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return info
    types = cfg.get("layer_types") or []
    params = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        params += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    info.update(model_type=cfg.get("model_type"), layers=cfg.get("num_hidden_layers"), hidden=cfg.get("hidden_size"),
                linear_layers=types.count("linear_attention"), attention_layers=types.count("full_attention"),
                vocab=cfg.get("vocab_size"), params=params or None)
    return info


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "device": os.environ.get("HYPIC_DEVICE", "cpu"),
                            "torch_threads": args.torch_threads if args.torch_threads is not None
                            else os.environ.get("HYPIC_TORCH_THREADS", "torch's default (gateway default)")}
    if info["device"].startswith("cuda") and shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False).stdout.strip()
        info["gpu"] = gpu.splitlines()[0] if gpu else None
    return info


def describe(args: argparse.Namespace, result: dict) -> str:
    """The Markdown section for docs/benchmarks.md."""
    m, mach, w = result["model"], result["machine"], result["workload"]
    cells, rates = result["cells"], [r if r is not None else BURST for r in result["rates"]]
    hit = result.get("steady_state_chunk_hit_rate")
    device = mach["device"] + (f" ({mach['gpu']})" if mach.get("gpu") else "")
    model = (f"`{Path(m['path']).name}` ({m.get('model_type')}, {m['params'] / 1e6:.1f}M parameters, "
             f"{m.get('layers')} layers: {m.get('linear_layers')} linear-attention, {m.get('attention_layers')} "
             f"full-attention; width {m.get('hidden')}; fp32)") if m.get("params") else f"`{m['path']}`"
    chunks = ("every chunk new (`--cold`)" if args.cold else
              f"{args.k} of {args.corpus_size} chunks per request, Zipf({args.zipf:g}) popularity, shuffled")
    lines = [
        "<!-- serve:begin -->",
        "## Serving load: open-loop Poisson arrivals, every mode",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {mach['cpus']} CPUs, device {device}, gateway torch threads {mach['torch_threads']}.  ",
        f"Model: {model}.  ",
        f"Workload: POST /v1/completions, streamed, greedy, {args.max_tokens} output tokens (ignore_eos); "
        f"segments: a {w['tokens']['system']}-token system prompt + {chunks} (~{w['tokens']['chunk']:.0f} tokens each); "
        f"a ~{w['tokens']['question']:.0f}-token question; ~{w['tokens']['prompt']:.0f} prompt tokens. "
        f"{args.num_requests} requests per rate after {args.warmup} warm-up requests, seed {args.seed}; "
        f"gateway restarted per {args.restart} (max_running {args.max_running}, max_queue {args.max_queue}). "
        f"Steady-state chunk hit rate (server counters, hypic cells): {_pct(hit)}.",
        "",
    ]
    if args.plot:
        try:
            rel = os.path.relpath(args.plot.resolve(), args.markdown.resolve().parent)
            lines += [f"![p50 TTFT vs request rate]({rel})", ""]
        except ValueError:
            pass
    if cells:
        lines += ["TTFT by rate and sustainable rate per mode:", "", summary_table(cells, rates, args.slo_ttft_ms), ""]
    if result.get("search"):
        lines += [f"Sustainable rate by search (doubling from {args.search_start:g} req/s, then bisection to "
                  f"{args.search_tolerance:.0%}; each probe {args.num_requests} requests, (x): missed the SLO):", "",
                  search_table(result["search"], args.slo_ttft_ms), ""]
    for r in rates:
        group = [c for c in cells if c["label"] == rate_label(r)]
        lines += [f"### {rate_label(r)}", "", cell_table(group), ""]
    if result.get("decode_scaling"):
        lines += ["### Decode scaling", "", decode_table(result["decode_scaling"]), ""]
    if result.get("cold_arrival"):
        lines += ["### Inter-token latency during a cold arrival (chunked prefill)", "",
                  arrival_table(result["cold_arrival"]), ""]
    lines += ["Speed-ups are full's (or prefix's) p50 divided by the mode's. Chunk hit rate: server, from "
              "hypic_segment_lookups_total counting the system prompt as a hit; ideal, the fraction of chunk "
              "occurrences the gateway had seen before (an unbounded cache).", "<!-- serve:end -->"]
    return "\n".join(lines)


def save(args: argparse.Namespace, result: dict) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("gateway")
    g.add_argument("--url", help="a running gateway (default: start one per mode on 127.0.0.1)")
    g.add_argument("--model", type=Path, default=ROOT / "models" / "hypic-tiny",
                   help="model directory served by managed gateways; its tokenizer.json sizes the texts")
    g.add_argument("--model-name", help="model name to send (default: the gateway's /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("HYPIC_API_KEY") or None,
                   help="bearer key for --url (default: HYPIC_API_KEY); managed gateways run without one")
    g.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    g.add_argument("--restart", choices=("mode", "cell"), default="mode",
                   help="fresh gateway per mode (rates measure consecutive request slices) or per cell (same slice)")
    g.add_argument("--max-running", type=int, default=8, help="HYPIC_MAX_RUNNING of managed gateways")
    g.add_argument("--max-queue", type=int, default=1024, help="HYPIC_MAX_QUEUE of managed gateways")
    g.add_argument("--torch-threads", type=int, default=None, help="HYPIC_TORCH_THREADS (default: the environment's)")
    g.add_argument("--seam", type=int, default=None, help="seam sent with every request (default: the gateway's)")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--keep-logs", action="store_true", help="keep the managed gateways' logs and index directories")
    w = ap.add_argument_group("workload")
    w.add_argument("--corpus-size", type=int, default=200)
    w.add_argument("--chunk-tokens", type=int, default=512)
    w.add_argument("--k", type=int, default=10, help="chunks per request")
    w.add_argument("--zipf", type=float, default=1.1, help="Zipf skew of chunk popularity (0: uniform)")
    w.add_argument("--cold", action="store_true", help="every chunk is new (no chunk ever repeats)")
    w.add_argument("--system-tokens", type=int, default=32)
    w.add_argument("--question-tokens", type=int, default=16)
    w.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    w.add_argument("--warmup", type=int, default=20, help="requests sent one at a time before measuring")
    w.add_argument("--seed", type=int, default=0)
    a = ap.add_argument_group("arrivals")
    a.add_argument("--rates", nargs="+", type=float, default=None,
                   help="Poisson request rates, req/s (default 0.5 1 2 4)")
    a.add_argument("--burst", action="store_true", help="also send every request at once")
    a.add_argument("--num-requests", type=int, default=100, help="requests per cell (at most)")
    a.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per cell (at most)")
    a.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    a.add_argument("--search", action="store_true",
                   help="find each mode's sustainable rate by search (doubling, then bisection) instead of a grid")
    a.add_argument("--search-start", type=float, default=0.5, help="first rate probed (req/s)")
    a.add_argument("--search-tolerance", type=float, default=0.15, help="stop when the bracket's rates are within this ratio - 1")
    a.add_argument("--search-probes", type=int, default=8, help="most probes (cells) per mode")
    a.add_argument("--search-min", type=float, default=0.01)
    a.add_argument("--search-max", type=float, default=1000.0)
    d = ap.add_argument_group("decode scaling")
    d.add_argument("--decode-scaling", action="store_true",
                   help="measure decode tokens/s with 1 and 8 streams (alone unless --rates or --burst is given)")
    d.add_argument("--decode-tokens", type=int, default=64)
    d.add_argument("--decode-reps", type=int, default=3)
    c = ap.add_argument_group("cold arrival")
    c.add_argument("--cold-arrival", action="store_true",
                   help="measure running streams' inter-token latency while a cold --k-chunk request prefills")
    c.add_argument("--arrival-step-tokens", type=int, nargs="+", default=[512, 65536],
                   help="HYPIC_MAX_STEP_TOKENS values to compare (a large one: no chunking)")
    c.add_argument("--arrival-streams", type=int, default=4)
    c.add_argument("--arrival-tokens", type=int, default=400, help="output tokens of each running stream")
    c.add_argument("--arrival-delay", type=float, default=2.0, help="seconds between starting the streams and the cold request")
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, help="write every result as JSON here")
    o.add_argument("--plot", type=Path, help="draw p50 TTFT vs request rate here (PNG)")
    o.add_argument("--markdown", type=Path, nargs="?", const=ROOT / "docs" / "benchmarks.md",
                   help="write the serve section of this Markdown file (default docs/benchmarks.md)")
    args = ap.parse_args(argv)
    if args.rates is None and not args.burst:
        args.rates = [] if (args.decode_scaling or args.cold_arrival or args.search) else [0.5, 1.0, 2.0, 4.0]
    if any(r <= 0 for r in args.rates or ()):
        ap.error("--rates must be positive")
    if args.duration <= 0 or args.num_requests < 1 or args.k < 1:
        ap.error("--duration, --num-requests and --k must be positive")
    if args.url:
        args.restart = "mode"  # nothing to restart; caches carry over
    args.model = args.model.resolve()
    return args


async def amain(args: argparse.Namespace) -> dict:
    tokenizer = args.model / "tokenizer.json"
    if not tokenizer.is_file():
        raise SystemExit(f"{tokenizer} not found: --model must be a model directory with tokenizer.json")
    maker = TextMaker(tokenizer)
    rates = sorted(args.rates or []) + ([BURST] if args.burst else [])
    slices = 1 if args.restart == "cell" else max(1, len(rates))
    if args.search:
        slices = max(slices, args.search_probes)
    t = time.perf_counter()
    workload = build_workload(args, maker, slices)
    _progress(f"workload: {len(workload.warmup)} warm-up + {len(workload.measured)} measured requests, "
              f"~{workload.tokens['prompt']:.0f} prompt tokens each ({time.perf_counter() - t:.1f} s to build)")
    timeout = httpx.Timeout(args.request_timeout, connect=10.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/serve.py", *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
        "machine": machine_info(args), "model": model_info(args.model),
        "workload": {"tokens": workload.tokens, "warmup": len(workload.warmup), "measured": len(workload.measured)},
        "rates": [None if r == BURST else r for r in rates], "cells": [],
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=False) as http:
        if args.url:
            if problem := await wait_ready(http, args.url, args.startup_timeout):
                raise SystemExit(f"gateway at {args.url}: {problem}")
            _progress(f"using the running gateway at {args.url}: its caches carry over from cell to cell")
        if rates:
            result["cells"] = await run_load(args, http, workload, rates,
                                             lambda cells: save(args, result | {"cells": cells, "partial": True}))
        if args.search:
            result["search"] = await search_rates(args, http, workload,
                                                  lambda found: save(args, result | {"search": found, "partial": True}))
        if args.decode_scaling:
            result["decode_scaling"] = await decode_scaling(args, http, maker, workload)
        if args.cold_arrival:
            result["cold_arrival"] = await cold_arrival(args, http, maker)
    result["steady_state_chunk_hit_rate"] = steady_state_hit_rate(result["cells"])
    result["sustainable_rate"] = sustainable(result["cells"], args.slo_ttft_ms)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind (and stop the gateways) on `timeout`, kill
    try:
        result = asyncio.run(amain(args))
    finally:
        for gateway in list(Gateway.live):
            gateway.stop()
    rates = [r if r is not None else BURST for r in result["rates"]]
    if result["cells"]:
        for r in rates:
            print(f"\n== {rate_label(r)} ==\n" + cell_table([c for c in result["cells"] if c["label"] == rate_label(r)]))
        print("\n" + summary_table(result["cells"], rates, args.slo_ttft_ms))
        print(f"\nsteady-state chunk hit rate (hypic or pic-naive): {_pct(result['steady_state_chunk_hit_rate'])}")
    if result.get("search"):
        print("\n" + search_table(result["search"], args.slo_ttft_ms))
    if result.get("decode_scaling"):
        print("\n" + decode_table(result["decode_scaling"]))
    if result.get("cold_arrival"):
        print("\n" + arrival_table(result["cold_arrival"]))
    if args.out:
        save(args, result)
        _progress(f"wrote {args.out}")
    if args.plot and result["cells"]:
        m = result["model"]
        size = f"{m['params'] / 1e6:.0f}M " if m.get("params") else ""
        plot(result["cells"], rates, args.plot,
             f"p50 TTFT vs Poisson request rate ({result['machine']['device']}, {size}{m.get('model_type') or ''}, "
             f"{args.k} x {args.chunk_tokens}-token chunks{', cold' if args.cold else ''})")
        _progress(f"wrote {args.plot}")
    if args.markdown:
        write_section(args.markdown, describe(args, result), "serve")
        _progress(f"wrote the serve section of {args.markdown}")


if __name__ == "__main__":
    main()
