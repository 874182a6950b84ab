"""Decode-sized matmuls on the CPU: y [R, out] = x [R, in] @ W^T (+ bias) for a few rows R, W [out, in].

A decode step reads every weight once for R = 1..8 rows (streams), so its matmuls are bound by the
bytes they read, and torch's kernels on this project's AVX2 CPU read them at 2-10 GB/s from two rows
on (docs/benchmarks.md). The kernels here give each thread (OpenMP) a contiguous range of W's rows,
read as 4 sequential streams (one per quarter of the range), and keep the 4 rows in hand in L1
while they meet every row of x (3 rows at a time, 12 accumulators), AVX2 + FMA:

- `f32`: fp32 weights. Exact up to summation order (sums of 8 lanes, then a horizontal sum).
- `f16`: fp16 weights (F16C conversion on load), half the bytes; lossy (the weights are rounded
  to fp16), so the decode step that uses it keeps it off by default.

They are built once with the system's C++ compiler into ~/.cache/hypic/kernels/<hash>/ (lines
logged at INFO say so and how long it took, about 1.5 s) and called through ctypes on the tensors' memory; `native()` returns
None, with the reason logged once as a warning, when there is no compiler, no AVX2/FMA/F16C or
the build fails, and the caller keeps torch's matmul. `reference` is the plain torch product the
tests compare them with.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("hypic.decode_matmul")

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// y[r, o + b * stride] for r < RB, b < OB: dot products of RB rows of x with OB rows of w (length n),
// the rows of w `stride` apart.
template <int RB, int OB, typename W>
static inline void block(const float* x, long ldx, const W* w, long n, float* y, long ldy, long o, long stride,
                         const float* bias) {
    __m256 acc[RB][OB];
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) acc[r][b] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 xv[RB];
        for (int r = 0; r < RB; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
        for (int b = 0; b < OB; b++) {
            __m256 wv = load8(w + (o + b * stride) * n + k);
            for (int r = 0; r < RB; r++) acc[r][b] = _mm256_fmadd_ps(xv[r], wv, acc[r][b]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) {
            const long ob = o + b * stride;
            float s = hsum(acc[r][b]);
            for (long t = k; t < n; t++) s += x[r * ldx + t] * load1(w + ob * n + t);
            y[r * ldy + ob] = s + (bias ? bias[ob] : 0.0f);
        }
}

// Every row of x (3 at a time: 12 accumulators) against the OB rows of w at o, o + stride, ...
template <int OB, typename W>
static inline void rows(const float* x, long R, long n, const W* w, float* y, long ldy, long o, long stride,
                        const float* bias) {
    long r = 0;
    for (; r + 3 <= R; r += 3) block<3, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias);
    if (R - r == 2) block<2, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias);
    if (R - r == 1) block<1, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias);
}

// Each thread takes a contiguous range of w's rows and reads it as 4 sequential streams, one per
// quarter of the range (row j of every quarter together): 4 long streams keep more memory requests in
// flight than one, and than 4 adjacent rows (short streams of a few KB) did.
template <typename W>
static void linear(const float* x, const W* w, const float* bias, float* y, long R, long n, long out, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        const long nt = omp_get_num_threads(), t = omp_get_thread_num();
        const long t0 = out * t / nt, t1 = out * (t + 1) / nt, q = (t1 - t0) / 4;
        for (long j = 0; j < q; j++) rows<4>(x, R, n, w, y, out, t0 + j, q, bias);
        for (long o = t0 + 4 * q; o < t1; o++) rows<1>(x, R, n, w, y, out, o, 1, bias);
    }
}

extern "C" {
void hypic_linear_f32(const float* x, const float* w, const float* bias, float* y, long R, long n, long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads);
}
void hypic_linear_f16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads);
}
}
"""

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_NEEDS = ("avx2", "fma", "f16c")


def cache_dir() -> Path:
    """Where built kernels are kept: $HYPIC_KERNELS_DIR, else ~/.cache/hypic/kernels."""
    env = os.environ.get("HYPIC_KERNELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hypic" / "kernels"


def cpu_reason() -> str | None:
    """Why this CPU cannot run the kernels (None: it can)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        flags = []
    missing = [f for f in _NEEDS if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


class NativeMatmul:
    """The built library: `linear(x, w, bias)` for fp32 x [R, in] (contiguous) and W [out, in] (fp32 or
    fp16, contiguous) on the CPU; returns a new fp32 [R, out]. Runs on torch's thread count."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        args = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        for name in ("hypic_linear_f32", "hypic_linear_f16"):
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, None
        self._fns = {torch.float32: self.lib.hypic_linear_f32, torch.float16: self.lib.hypic_linear_f16}

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        R, n = x.shape
        out = w.shape[0]
        if (x.dtype != torch.float32 or w.dtype not in self._fns or w.shape[1] != n or x.device.type != "cpu"
                or not (w.is_contiguous() and x.is_contiguous())):
            raise ValueError(f"linear needs contiguous fp32 x [R, {w.shape[1]}] and fp32/fp16 W [out, in] on the CPU; "
                             f"got x {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous fp32 [{out}], got {bias.dtype} {tuple(bias.shape)}")
        y = torch.empty(R, out, dtype=torch.float32)
        self._fns[w.dtype](x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                           R, n, out, torch.get_num_threads())
        return y


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch product the kernels compute: x @ W.float()^T (+ bias), fp32."""
    return torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())


_lock = threading.Lock()
_built: dict[str, NativeMatmul | str] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(compiler: str | None = None, directory: Path | None = None) -> NativeMatmul:
    """Compile SOURCE (once per source, flags and compiler; later calls load the cached library).
    Raises RuntimeError with the reason when it cannot."""
    if (reason := cpu_reason()) is not None:
        raise RuntimeError(reason)
    compiler = compiler or _compiler()
    if compiler is None or shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler found ({compiler or 'set CXX, or install g++'})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE, " ".join(FLAGS), *version]).encode()).hexdigest()[:16]
    target = (directory or cache_dir()) / key / "libhypic_decode_matmul.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        log.info("compiling the decode matmul kernels (%s, once) into %s", os.path.basename(compiler), target.parent)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / "decode_matmul.cpp", Path(tmp) / target.name
            src.write_text(SOURCE)
            done = subprocess.run([compiler, *FLAGS, str(src), "-o", str(lib)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(lib, target)  # atomic: a concurrent builder finds a whole library or none
        log.info("decode matmul kernels built in %.1f s", time.perf_counter() - t0)
    return NativeMatmul(target)


def native(compiler: str | None = None) -> NativeMatmul | None:
    """The kernels of this process (built or loaded on first use), or None when they cannot be had here:
    the reason is then logged once as a warning and the caller runs torch's matmul instead."""
    name = compiler or _compiler() or ""
    with _lock:
        if name not in _built:
            try:
                _built[name] = build(compiler)
            except (RuntimeError, OSError) as exc:
                log.warning("decode matmul kernels unavailable, torch's matmul runs instead: %s", exc)
                _built[name] = str(exc)
        got = _built[name]
    return got if isinstance(got, NativeMatmul) else None
