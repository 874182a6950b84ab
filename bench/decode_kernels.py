"""The matmuls of a decode step on this CPU: weight layout, kernel and precision against rows (streams).

A decode step is bound by its matmuls: B rows times each weight. Timed here, `--threads` torch
threads, median of 3 rounds, for B = 1, 2, 4, 8 rows, on the weights of the decode step's fused
projections (each repeated until a set is about 128 MB, so it streams from memory; the lm_head
once): SmolLM2's and the hybrid's gate-up 3072x576, down 576x1536, attention QKV 960x576, the
hybrid's Mamba2 in_proj 3474x576 and out_proj 576x1152, and the tied lm_head 49152x576. Kernels:
- `F.linear` on the [out, in] weight (what the HF modules run),
- `torch.mm` on the weight stored transposed, [in, out] contiguous (what the lean step runs),
- `torch.mv` / `torch.addmv` (MKL sgemv) on either layout, one row only,
- oneDNN's packed fp32 linear (`torch.ops.mkldnn._linear_pointwise` on a `_reorder_linear_weight`),
- bf16 weights (`F.linear`), int8 weight-only (`torch._weight_int8pack_mm`, per-row scales),
- fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`, per-channel int8 weights,
  activations quantized per call),
- the native kernels of hypic_core/native/decode_matmul.py on [out, in]: fp32 (`native f32`), fp16
  weights (`native f16`), bf16 weights (`native bf16`) and per-row int8 weights (`native i8`), of the
  ISA variant this CPU picks, or of each `--variants` name (`native f32 [avx2]`, ...; built once with
  the C++ compiler, skipped when none is found).
Every kernel's output is checked against the fp32 product (max abs error printed). Printed as
microseconds per weight, the fp32 bytes that would stream per second ("fp32-equivalent GB/s") and
the bytes the kernel really reads per second, beside the machine's bandwidth measured at the same
thread count (sum of a 512 MB tensor; a copy, read + write) as the floor.

Run:  .venv/bin/python bench/decode_kernels.py --threads 2 [--rows 1 2 4 8] [--shapes gate_up lm_head ...]
      [--kernels "F.linear [out, in]" "native f32" ...] [--rounds 3] [--variants avx512 avx2 generic]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode import bandwidth  # noqa: E402  (bench/ is the script directory)
from hypic_core.native import decode_matmul  # noqa: E402

SET_BYTES = 128 << 20
SHAPES = {  # name: (out, in) of the decode step's fused weights
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "qkv": (960, 576),
    "mamba_in": (3474, 576),
    "mamba_out": (576, 1152),
    "lm_head": (49152, 576),
}


def timed(f, n: int, per: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n / per * 1e6


class Weights:
    """`copies` random [out, in] weights and every layout / precision the kernels read."""

    def __init__(self, out: int, inp: int, copies: int, native: bool):
        self.ws = [torch.randn(out, inp) / math.sqrt(inp) for _ in range(copies)]
        self.wts = [w.t().contiguous() for w in self.ws]
        self.wb = [w.to(torch.bfloat16) for w in self.ws]
        self.scales = [w.abs().amax(1) / 127 for w in self.ws]
        self.wq = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(self.ws, self.scales)]
        torch.backends.quantized.engine = "fbgemm"
        self.fbgemm = [torch.ops.quantized.linear_prepack(
            torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(out, dtype=torch.long), 0, torch.qint8), None)
            for w in self.ws]
        self.wh = [w.half() for w in self.ws] if native else []
        self.wbf = [decode_matmul.to_bf16(w) for w in self.ws] if native else []
        self.wi8 = [decode_matmul.quantize_int8(w) for w in self.ws] if native else []
        self.packed: dict[int, list] = {}

    def packed_for(self, rows: int) -> list:
        if rows not in self.packed:
            self.packed = {rows: [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in self.ws]}
        return self.packed[rows]


def kernels(W: Weights, x: torch.Tensor, natives: dict) -> dict[str, tuple]:
    """name: (run over every copy -> list of outputs, bytes per weight element read)."""
    rows = x.shape[0]
    xb = x.to(torch.bfloat16)
    packed = W.packed_for(rows)
    out = {
        "F.linear [out, in]": (lambda: [F.linear(x, w) for w in W.ws], 4),
        "mm [in, out]": (lambda: [torch.mm(x, w) for w in W.wts], 4),
        "oneDNN packed fp32": (lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed], 4),
        "bf16 F.linear": (lambda: [F.linear(xb, w) for w in W.wb], 2),
        "int8 weight-only": (lambda: [torch._weight_int8pack_mm(x, w, s) for w, s in zip(W.wq, W.scales)], 1),
        "fbgemm int8 dynamic": (lambda: [torch.ops.quantized.linear_dynamic(x, p, True) for p in W.fbgemm], 1),
    }
    if rows == 1:
        v = x[0]
        zero = torch.zeros(W.ws[0].shape[0])
        out["mv [out, in]"] = (lambda: [torch.mv(w, v)[None] for w in W.ws], 4)
        out["addmv [out, in]"] = (lambda: [torch.addmv(zero, w, v)[None] for w in W.ws], 4)
        out["mv [in, out]"] = (lambda: [torch.mv(w.t(), v)[None] for w in W.wts], 4)
    for tag, nat in natives.items():
        out[f"native f32{tag}"] = (lambda nat=nat: [nat.linear(x, w) for w in W.ws], 4)
        out[f"native f16{tag}"] = (lambda nat=nat: [nat.linear(x, w) for w in W.wh], 2)
        out[f"native bf16{tag}"] = (lambda nat=nat: [nat.linear(x, w) for w in W.wbf], 2)
        out[f"native i8{tag}"] = (lambda nat=nat: [nat.linear(x, q, None, s) for q, s in W.wi8], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kernels", nargs="+", default=None, help="only these kernels (names as printed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=None, help="native kernel ISA variants to compare "
                    "(hypic_core/native/library.py; default: the one this CPU picks)")
    ap.add_argument("--set-mb", type=int, default=SET_BYTES >> 20, help="MB of fp32 weights per shape (copies)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hypic.decode_matmul").setLevel(logging.INFO)  # the kernels' build lines
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    native = decode_matmul.native()
    if args.variants and native is not None:
        natives = {f" [{v}]": decode_matmul.build(variant=v) for v in args.variants}
    else:
        natives = {"": native} if native is not None else {}
    bw_sum, bw_copy = bandwidth()
    print(f"{args.threads} torch thread(s); load average at start {open('/proc/loadavg').read().split()[0]}; "
          f"bandwidth: sum {bw_sum:.1f} GB/s, copy {bw_copy:.1f} GB/s (read + write); native kernels: "
          f"{', '.join(f'{n.variant} {n.path}' for n in natives.values()) or 'unavailable (see warning)'}", flush=True)
    print("| weight | rows | kernel | us per weight | fp32-equivalent GB/s | GB/s read | / sum bandwidth | max abs err |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    table: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    for name in args.shapes:
        out, inp = SHAPES[name]
        copies = max(1, round((args.set_mb << 20) / (out * inp * 4)))
        W = Weights(out, inp, copies, native is not None)
        label = f"{name} {out}x{inp}" + (f" (x{copies})" if copies > 1 else "")
        n = max(2, 6 // copies) if copies > 1 else 6
        for rows in args.rows:
            x = torch.randn(rows, inp)
            ref = F.linear(x, W.ws[0])
            ks = kernels(W, x, natives)
            if args.kernels:
                ks = {k: v for k, v in ks.items() if k in args.kernels}
            got = {k: [] for k in ks}
            for _ in range(args.rounds):
                for k, (f, _) in ks.items():
                    got[k].append(timed(f, n, copies))
            for k, (f, nbytes) in ks.items():
                us = statistics.median(got[k])
                err = (f()[0].float() - ref).abs().max().item()
                fp32_gbs = out * inp * 4 / us / 1e3
                read_gbs = out * inp * nbytes / us / 1e3
                table.setdefault((label, rows), {})[k] = (us, fp32_gbs)
                print(f"| {label} | {rows} | {k} | {us:.0f} | {fp32_gbs:.1f} | {read_gbs:.1f} | {read_gbs / bw_sum:.2f} | "
                      f"{err:.1e} |", flush=True)
    print(f"load average at end {open('/proc/loadavg').read().split()[0]}")
    names = list(dict.fromkeys(k for row in table.values() for k in row))
    print()
    print("us per weight (fp32-equivalent GB/s); the fastest fp32 kernel in bold")
    print("| weight | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    fp32 = {"F.linear [out, in]", "mm [in, out]", "oneDNN packed fp32", "mv [out, in]", "addmv [out, in]", "mv [in, out]",
            *(f"native f32{tag}" for tag in natives)}
    for (label, rows), row in table.items():
        best = min((row[k][0], k) for k in row if k in fp32)[1] if any(k in fp32 for k in row) else None
        cells = []
        for k in names:
            if k not in row:
                cells.append("")
                continue
            us, gbs = row[k]
            cell = f"{us:.0f} ({gbs:.1f})"
            cells.append(f"**{cell}**" if k == best else cell)
        print(f"| {label} | {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
