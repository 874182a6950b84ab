"""The matmuls of a decode step on this CPU: weight layout and precision against rows (streams).

A decode step is bound by its matmuls: B rows times each weight. Timed here, one torch thread,
median of 3 rounds: an MLP-sized weight (3072 x 576, 40 copies so they stream from memory) and
SmolLM2's lm_head (49152 x 576), for B = 1, 2, 4, 8 rows, as
- `F.linear` on the [out, in] weight (what the HF modules run),
- `torch.mm` on the weight stored transposed, [in, out] contiguous (what the lean step runs),
- bf16 weights (`F.linear`), int8 weight-only (`torch._weight_int8pack_mm`, per-row scales),
- oneDNN's packed fp32 linear (`torch.ops.mkldnn._linear_pointwise` on a `_reorder_linear_weight`).
Printed as microseconds per weight and the fp32 bytes that would stream per second.

Run:  .venv/bin/python bench/decode_kernels.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def timed(f, n: int, per: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n / per * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print("| weight | rows | kernel | us per weight | fp32-equivalent GB/s |")
    print("|---|---:|---|---:|---:|")
    for label, (out, inp, copies) in (("MLP 3072x576 (x40)", (3072, 576, 40)), ("lm_head 49152x576", (49152, 576, 1))):
        ws = [torch.randn(out, inp) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        wb = [w.to(torch.bfloat16) for w in ws]
        scales = [w.abs().amax(1) / 127 for w in ws]
        wq = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(ws, scales)]
        n = 3 if copies > 1 else 6
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, inp)
            xb = x.to(torch.bfloat16)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            kernels = {
                "F.linear [out, in]": lambda: [F.linear(x, w) for w in ws],
                "mm [in, out]": lambda: [torch.mm(x, w) for w in wts],
                "oneDNN packed fp32": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed],
                "bf16 F.linear": lambda: [F.linear(xb, w) for w in wb],
                "int8 weight-only": lambda: [torch._weight_int8pack_mm(x, w, s) for w, s in zip(wq, scales)],
            }
            got = {k: [] for k in kernels}
            for _ in range(3):
                for k, f in kernels.items():
                    got[k].append(timed(f, n, copies))
            for k, v in got.items():
                us = statistics.median(v)
                print(f"| {label} | {rows} | {k} | {us:.0f} | {out * inp * 4 / us / 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
