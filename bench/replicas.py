"""Replica routing benchmark: N gateway replicas on Ray Serve, chunk-aware routing against Ray's
power-of-two choices, on the Zipf RAG workload of bench/serve.py.

For each router (`--routers chunk pow2`), a fresh `hypic serve-ray` subprocess (its own local
Ray instance, `--replicas` replicas, HYPIC_RAY_ROUTER set) gets the same warm-up and measured
requests (streaming POST /v1/completions, mode hypic, Poisson arrivals at each `--rates`), and
the benchmark reports side by side: TTFT, the chunk hit rate by cache tier and the share of
requests each replica served. Server counters are summed over the replicas: GET /metrics is
asked of each replica by name (the `X-Hypic-Replica` request header), and the gauges are sampled
every `--gauge-interval` s (each sample is a request per replica through Serve).

Every option of bench/serve.py's workload and arrivals applies (--corpus-size, --chunk-tokens,
--k, --zipf, --rates, --num-requests, --warmup, --max-tokens, --seed, ...); the replicas share
one disk tier (beside their index) unless `--memory-only` (the memory tier alone shows where
routing matters most) or HYPIC_CACHE_DIR says otherwise. Other HYPIC_* variables pass through
(HYPIC_DEVICE, HYPIC_RAY_REPLICA_GPUS=0.5 for two replicas on one GPU, HYPIC_REDIS_URL, ...).

Validate (tiny: about 3 minutes on 2 CPU cores, most of it Ray and model start-up):
    .venv/bin/python bench/replicas.py --rates 2 --num-requests 12 --warmup 4 --corpus-size 12 \\
        --chunk-tokens 48 --k 3 --max-tokens 4 --replica-cpus 0 --out /tmp/replicas_tiny.json

Clean measurement (bench model; one machine with >= 4 free cores, or a GPU with
HYPIC_DEVICE=cuda HYPIC_RAY_REPLICA_GPUS=0.5):
    .venv/bin/python bench/make_bench_model.py /tmp/bench-model
    .venv/bin/python bench/replicas.py --model /tmp/bench-model --replicas 2 --rates 0.2 0.4 \\
        --num-requests 60 --warmup 20 --corpus-size 200 --chunk-tokens 512 --k 10 --zipf 1.1 \\
        --max-tokens 32 --memory-only --out /tmp/replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import httpx

import serve as sb  # bench/serve.py (bench/ is the script directory)

ROUTERS = ("chunk", "pow2")


class RayGateway(sb.Gateway):
    """`hypic serve-ray` in a subprocess: its own local Ray instance and `--replicas` replicas."""

    def __init__(self, args: argparse.Namespace, router: str) -> None:
        super().__init__(args, f"ray-{router}", extra_env={
            "HYPIC_RAY_ROUTER": router, "HYPIC_RAY_REPLICAS": str(args.replicas),
            "HYPIC_RAY_LOAD_BOUND": str(args.load_bound), "HYPIC_RAY_REPLICA_CPUS": f"{args.replica_cpus:g}",
            "PYTHONPATH": str(sb.ROOT), "RAY_DEDUP_LOGS": "0",
            **({"HYPIC_CACHE_DIR": "none"} if args.memory_only else {})})
        self.router = router

    async def start(self, http: httpx.AsyncClient) -> str:
        port = sb._free_port()
        self.base = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve-ray"], cwd=sb.ROOT, env=self.env(port),
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        sb.Gateway.live.add(self)
        proc = self.proc

        def dead() -> str | None:
            return None if proc.poll() is None else f"exited with status {proc.returncode} while starting"

        problem = await sb.wait_ready(http, self.base, self.args.startup_timeout, dead)
        if not problem:
            self.replicas = sorted(await replica_ids(http, self.base, self.args.replicas, "/ready", timeout=self.args.startup_timeout))
            problem = None if len(self.replicas) == self.args.replicas else f"only replicas {self.replicas} became ready"
        if problem:
            self.fail(problem)
        sb._progress(f"[{self.label}] {self.args.replicas} replicas ready on {self.base} in {time.perf_counter() - started:.1f} s")
        return self.base


async def replica_ids(http: httpx.AsyncClient, base: str, n: int, path: str, timeout: float = 60.0,
                      want: int = 200) -> dict[str, httpx.Response]:
    """GET `path` until `n` different replicas answered `want`; {replica id: its response}."""
    seen: dict[str, httpx.Response] = {}
    deadline = time.perf_counter() + timeout
    while len(seen) < n and time.perf_counter() < deadline:
        try:
            response = await http.get(base + path)
            if response.status_code == want and (rid := response.headers.get("x-hypic-replica")):
                seen.setdefault(rid, response)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.02)
    return seen


class ReplicasClient(sb.Client):
    """bench/serve.py's client, with metrics summed over every replica (each asked by name)."""

    def __init__(self, *a, replicas: list[str], **kw) -> None:
        super().__init__(*a, **kw)
        self.replicas = replicas

    async def metrics(self) -> sb.Sample:
        out: sb.Sample = {}
        for replica in self.replicas:
            response = await self.http.get(self.base + "/metrics", headers={"X-Hypic-Replica": replica})
            response.raise_for_status()
            if response.headers.get("x-hypic-replica") != replica:
                raise ValueError(f"/metrics for replica {replica} answered by {response.headers.get('x-hypic-replica')}")
            for key, value in sb.parse_prometheus(response.text).items():
                out[key] = out.get(key, 0.0) + value
        return out


async def run_router(args: argparse.Namespace, http: httpx.AsyncClient, workload: sb.Workload, router: str,
                     rates: list[float]) -> list[dict]:
    served: Counter = Counter()

    async def count(response: httpx.Response) -> None:
        if response.request.url.path == sb.ROUTE and (rid := response.headers.get("x-hypic-replica")):
            served[rid] += 1

    http.event_hooks["response"] = [count]
    gateway = RayGateway(args, router)
    watch = sb.watch_gauges
    # run_cell samples the gauges every 0.25 s: here each sample is a request per replica through
    # Serve, so it is sampled less often, not to load the replicas it measures.
    sb.watch_gauges = lambda client, stop: watch(client, stop, interval=args.gauge_interval)
    cells = []
    try:
        base = await gateway.start(http)
        client = ReplicasClient(base, http, args.model_name or await sb.served_model(http, base), args, replicas=gateway.replicas)
        tracker = sb.ReuseTracker()
        tracker.feed(workload.warmup)
        await sb.warm(client, workload.warmup, "hypic", f"{router} warm-up")
        for i, rate in enumerate(rates):
            served.clear()
            items = workload.slice(i)
            times = sb.arrival_times(len(items), rate, args.seed, args.duration)
            items = items[:len(times)]
            reuse = tracker.feed(items)
            outcomes, duration, delta, gauges = await sb.run_cell(client, items, times, "hypic")
            cell = sb.summarize("hypic", rate, outcomes, duration, delta, gauges, args.k, reuse)
            cell |= {"router": router, "served_by_replica": sorted(served.values(), reverse=True)}
            cells.append(cell)
            sb._progress(f"[{router}] " + sb.cell_line(cell) + f", per replica {cell['served_by_replica']}")
    finally:
        gateway.stop()
        http.event_hooks["response"] = []
        sb.watch_gauges = watch
    return cells


def comparison(cells: list[dict], rates: list[float]) -> str:
    """A row per router and rate; the last columns compare with the first router's row at that rate."""
    header = ["router", "rate", "TTFT p50 / p95 (ms)", "chunk hit rate: server / ideal", "store hits by tier",
              "requests per replica", "TTFT p50 speed-up vs first router"]
    rows = []
    for rate in rates:
        group = [c for c in cells if c["label"] == sb.rate_label(rate)]
        base = group[0]["ttft_ms"]["p50"] if group else None
        for c in group:
            s = c["server"]
            tiers = ", ".join(f"{t} {sb._pct(v)}" for t, v in s["store_hit_rate_by_tier"].items()) or "-"
            rows.append([c["router"], c["label"], f"{sb._f(c['ttft_ms']['p50'])} / {sb._f(c['ttft_ms']['p95'])}",
                         f"{sb._pct(s['chunk_hit_rate'])} / {sb._pct(c['client_chunk_reuse'])}", tiers,
                         " / ".join(map(str, c["served_by_replica"])), sb._ratio(base, c["ttft_ms"]["p50"])])
    return sb.table(header, rows)


async def amain(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    tokenizer = args.model / "tokenizer.json"
    if not tokenizer.is_file():
        raise SystemExit(f"{tokenizer} not found: --model must be a model directory with tokenizer.json")
    rates = sorted(args.rates or [1.0])
    workload = sb.build_workload(args, sb.TextMaker(tokenizer), len(rates))
    sb._progress(f"workload: {len(workload.warmup)} warm-up + {len(workload.measured)} measured requests, "
                 f"~{workload.tokens['prompt']:.0f} prompt tokens each")
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/replicas.py", *argv]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
        "machine": sb.machine_info(args), "model": sb.model_info(args.model),
        "workload": {"tokens": workload.tokens, "warmup": len(workload.warmup), "measured": len(workload.measured)},
        "rates": rates, "cells": [],
    }
    timeout = httpx.Timeout(args.request_timeout, connect=10.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        for router in args.routers:
            result["cells"] += await run_router(args, http, workload, router, rates)
            sb.save(args, result | {"partial": True})
    return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    ap.add_argument("--load-bound", type=int, default=2, help="HYPIC_RAY_LOAD_BOUND")
    ap.add_argument("--replica-cpus", type=float, default=1.0, help="HYPIC_RAY_REPLICA_CPUS (0 on a 2-core machine)")
    ap.add_argument("--memory-only", action="store_true", help="no disk tier (HYPIC_CACHE_DIR=none)")
    ap.add_argument("--gauge-interval", type=float, default=2.0, help="seconds between samples of the running / waiting gauges")
    ours, rest = ap.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        ap.print_help()
        print("\nand bench/serve.py's options:")
    args = sb.parse_args(rest)
    if args.url:
        raise SystemExit("--url is not supported: each router needs its own fresh replicas")
    for name, value in vars(ours).items():
        setattr(args, name, value)
    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        result = asyncio.run(amain(args, argv))
    finally:
        for gateway in list(sb.Gateway.live):
            gateway.stop()
    print("\n" + comparison(result["cells"], result["rates"]))
    if args.out:
        sb.save(args, result)
        sb._progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
