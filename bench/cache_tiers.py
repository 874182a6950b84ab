"""Time to serve one cached segment from each tier vs recomputing it, and bytes per entry.

For each chunk length, on a benchmark-sized random Qwen3.5 model (~45M params, fp32):
- recompute: the canonical entry computed from scratch (`ModelRunner.compute_entries`, what
  a store miss costs);
- host: a hit in the host-memory tier;
- disk fp32 / disk bf16: a hit in the disk tier from a fresh store (empty memory tiers, as
  after a restart): index lookup, file read, checksum, safetensors parse, dtype restore; in
  parentheses the `decode` share alone (checksum, parse, dtype restore of bytes in memory).
  The OS page cache is warm (the value was just written); a cold read adds the device's
  read time.
- device: a hit in the GPU tier (only when CUDA is present).
Prints one table with ratios (median recompute time / median tier time) and the policy it
implies (judged on the fastest recompute, the conservative side on a shared machine).

    python bench/cache_tiers.py [--lengths 128 512 2048] [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from hypic_core.adapters import adapter_for  # noqa: E402
from hypic_core.algebra.keys import SegmentKey  # noqa: E402
from hypic_core.cache import DiskTier, MemoryTier, TieredSegmentStore, decode, encode  # noqa: E402
from hypic_core.runner.model_runner import ModelRunner  # noqa: E402
from hypic_core.testing import slow_decay  # noqa: E402

SEAM = 8


def bench_model() -> torch.nn.Module:
    """hidden 512, 8 layers (3 linear : 1 full), 128-dim linear heads, 32k vocab (tied): ~45M params."""
    import transformers as tf

    cfg = tf.Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
        max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    slow_decay(model)
    return model


def timed(fn, reps: int) -> float:
    """Median wall time of `fn()` in ms, after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(out)



def time_recompute(recompute, lengths, reps: int) -> tuple[dict, dict[int, list[float]]]:
    """({length: entry}, {length: [ms per recompute]}). Timed in rounds over all lengths after one
    warm-up round, so the slow first forwards of a process (allocator, lazy init) and load drift
    spread over every length."""
    entries = {L: recompute(L) for L in lengths}
    times: dict[int, list[float]] = {L: [] for L in lengths}
    for _ in range(reps):
        for L in lengths:
            t = time.perf_counter()
            recompute(L)
            times[L].append((time.perf_counter() - t) * 1000.0)
    return entries, times

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = bench_model()
    device = model.device
    runner = ModelRunner(model, adapter_for(model))
    params = sum(p.numel() for p in model.parameters())
    cuda = torch.cuda.is_available()
    print(f"model: qwen3_5 random, {params / 1e6:.1f}M params fp32, device {device}, torch threads {args.threads}, "
          f"seam {SEAM}, median of {args.reps}")
    g = torch.Generator().manual_seed(0)
    segments = {L: tuple(torch.randint(2, 32000, (L,), generator=g).tolist()) for L in args.lengths}

    def recompute(L: int):
        with torch.inference_mode():
            return runner.compute_entries([segments[L]], SEAM, 1 << 20)[0]

    entries, times = time_recompute(recompute, args.lengths, args.reps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        disks = {dt: DiskTier(os.path.join(tmp, dt), size_limit=8 << 30) for dt in ("fp32", "bf16")}
        for L in args.lengths:
            seg, entry = segments[L], entries[L]
            key = SegmentKey.of("bench-model", SEAM, seg)
            t_recompute = (statistics.median(times[L]), min(times[L]))
            host = TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 1 << 34)])
            host.insert(key, entry)
            t_host = timed(lambda: host.lookup(key, seg), args.reps * 4)
            t_device = None
            if cuda:
                dev = TieredSegmentStore(device, [MemoryTier("device", device, 1 << 34)])
                dev.insert(key, entry.to(device))
                t_device = timed(lambda: dev.lookup(key, seg), args.reps * 4)
            t_disk, size = {}, {}
            for dt, disk in disks.items():
                storage = "auto" if dt == "fp32" else dt  # the store's name for "as computed" (fp32 here)
                writer = TieredSegmentStore(device, [MemoryTier("host", "cpu", 1 << 34)], disk, storage_dtype=storage)
                writer.insert(key, entry)
                writer.flush()
                data = encode(entry, key, storage)
                size[dt] = len(data)
                t_disk[f"decode {dt}"] = timed(lambda data=data, storage=storage: decode(data, key, seg, storage), args.reps)

                def disk_hit(storage=storage, disk=disk):
                    fresh = TieredSegmentStore(device, [MemoryTier("host", "cpu", 1 << 34)], disk, storage_dtype=storage)
                    assert fresh.lookup(key, seg) is not None and fresh.stats().hits["disk"] == 1
                t_disk[dt] = timed(disk_hit, args.reps)
            rows.append((L, entry.nbytes, size, t_recompute, t_host, t_device, t_disk))
        for disk in disks.values():
            disk.close()

    print()
    head = ["tokens", "entry MiB", "disk MiB fp32/bf16", "recompute ms (min)", "host ms", "device ms",
            "disk fp32 ms (decode)", "disk bf16 ms (decode)", "x host", "x disk fp32", "x disk bf16"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for L, nbytes, size, (tr, tr_min), th, td, tdisk in rows:
        cells = [str(L), f"{nbytes / 2**20:.2f}", f"{size['fp32'] / 2**20:.2f} / {size['bf16'] / 2**20:.2f}",
                 f"{tr:.1f} ({tr_min:.1f})", f"{th:.3f}", "n/a (no GPU)" if td is None else f"{td:.3f}",
                 f"{tdisk['fp32']:.1f} ({tdisk['decode fp32']:.1f})", f"{tdisk['bf16']:.1f} ({tdisk['decode bf16']:.1f})",
                 f"{tr / th:.0f}x",
                 f"{tr / tdisk['fp32']:.2f}x", f"{tr / tdisk['bf16']:.2f}x"]
        print(" | ".join(cells))
    losing = [L for L, _, _, (_, tr_min), _, _, tdisk in rows if tdisk["fp32"] >= tr_min]
    print()
    if losing:
        print(f"disk tier does not pay for {losing}-token chunks: set disk_min_tokens above {max(losing)}")
    else:
        print("disk tier pays for every measured length")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
