"""Decode-sized matmuls on the CPU: y [R, out] = x [R, in] @ W^T (+ bias) for a few rows R, W [out, in].

A decode step reads every weight once for R = 1..8 rows (streams), so its matmuls are bound by the
bytes they read, and torch's kernels on this project's AVX2 CPU read them at 2-10 GB/s from two rows
on (docs/benchmarks.md). The kernels here give each thread (OpenMP) a contiguous range of W's rows,
read as 4 sequential streams (one per quarter of the range), and keep the 4 rows in hand in L1
while they meet every row of x (3 rows at a time, 12 accumulators), AVX2 + FMA:

- `f32`: fp32 weights. Exact up to summation order (sums of 8 lanes, then a horizontal sum).
- `f16`: fp16 weights (F16C conversion on load), half the bytes; lossy (the weights are rounded
  to fp16), so the decode step that uses it keeps it off by default.
- `i8`: int8 weights with one fp32 scale per output row (`quantize_int8`: symmetric, max |w| -> 127),
  a quarter of the bytes; lossier still, off by default.

The same library holds the decode step's other fp32 ops (`add_rmsnorm`, `silu_mul`, `attend`, `mamba2`:
the residual add with its norm, the MLP's gate, one attention layer, one Mamba2 mixer between its
projections), each one call where torch ran 5-30 small ops; tests/engine/test_decode_ops.py holds
each to the torch code it replaces.

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
#include <math.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
static inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline float load1(const int8_t* p) { return (float)*p; }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// y[r, o + b * stride] for r < RB, b < OB: dot products of RB rows of x with OB rows of w (length n),
// the rows of w `stride` apart, each times its row's scale (int8 weights; null: 1) plus its bias.
template <int RB, int OB, typename W>
static inline void block(const float* x, long ldx, const W* w, long n, float* y, long ldy, long o, long stride,
                         const float* bias, const float* scales) {
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
            y[r * ldy + ob] = (scales ? s * scales[ob] : s) + (bias ? bias[ob] : 0.0f);
        }
}

// Every row of x (3 at a time: 12 accumulators) against the OB rows of w at o, o + stride, ...
template <int OB, typename W>
static inline void rows(const float* x, long R, long n, const W* w, float* y, long ldy, long o, long stride,
                        const float* bias, const float* scales) {
    long r = 0;
    for (; r + 3 <= R; r += 3) block<3, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
    if (R - r == 2) block<2, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
    if (R - r == 1) block<1, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
}

// Each thread takes a contiguous range of w's rows and reads it as 4 sequential streams, one per
// quarter of the range (row j of every quarter together): 4 long streams keep more memory requests in
// flight than one, and than 4 adjacent rows (short streams of a few KB) did.
template <typename W>
static void linear(const float* x, const W* w, const float* bias, float* y, long R, long n, long out, int threads,
                   const float* scales = nullptr) {
    #pragma omp parallel num_threads(threads)
    {
        const long nt = omp_get_num_threads(), t = omp_get_thread_num();
        const long t0 = out * t / nt, t1 = out * (t + 1) / nt, q = (t1 - t0) / 4;
        for (long j = 0; j < q; j++) rows<4>(x, R, n, w, y, out, t0 + j, q, bias, scales);
        for (long o = t0 + 4 * q; o < t1; o++) rows<1>(x, R, n, w, y, out, o, 1, bias, scales);
    }
}

// ---- the step's other ops (fp32) ----------------------------------------------------------------
// exp on 8 lanes (Cephes' polynomial on x - n ln2; relative error ~2e-7), for x >= -87 (smaller: ~0).
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float dot(const float* a, const float* b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

// h [R, n] += d (when d is not null); out = w * h / sqrt(mean(h^2) + eps), row by row.
static void add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n) {
    for (long r = 0; r < R; r++) {
        float* hr = h + r * n;
        if (d) for (long i = 0; i < n; i++) hr[i] += d[r * n + i];
        const float inv = 1.0f / sqrtf(dot(hr, hr, n) / n + eps);
        for (long i = 0; i < n; i++) out[r * n + i] = w[i] * (hr[i] * inv);
    }
}

// out [R, n] = silu(gu[:, :n]) * gu[:, n:], gu [R, 2n].
static void silu_mul(const float* gu, float* out, long R, long n) {
    for (long r = 0; r < R; r++) {
        const float* g = gu + r * 2 * n;
        const float* u = g + n;
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(out + r * n + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) out[r * n + i] = silu1(g[i]) * u[i];
    }
}

// Rotate-half RoPE of x's first `rot` dims (cos, sin [rot]), in place.
static inline void rope(float* x, const float* cos, const float* sin, long rot) {
    const long half = rot / 2;
    for (long i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// s[t] = scale * q . K[t] for the n rows of K (D floats each); 4 rows at a time, DV = D / 8 vectors of q
// held in registers (DV = 0: any D).
template <int DV>
static void scores_d(const float* q, const float* K, long n, long D, float scale, float* s) {
    __m256 qv[DV];
    for (int i = 0; i < DV; i++) qv[i] = _mm256_loadu_ps(q + 8 * i);
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        const float* k = K + t * D;
        __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k + D));
        __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k + 2 * D)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k + 3 * D));
        for (int i = 1; i < DV; i++) {
            a0 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 8 * i), a0);
            a1 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + D + 8 * i), a1);
            a2 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 2 * D + 8 * i), a2);
            a3 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 3 * D + 8 * i), a3);
        }
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(s + t, _mm_mul_ps(r, _mm_set1_ps(scale)));
    }
    for (; t < n; t++) s[t] = dot(q, K + t * D, D) * scale;
}

static void scores(const float* q, const float* K, long n, long D, float scale, float* s) {
    switch (D) {
        case 32: scores_d<4>(q, K, n, D, scale, s); return;
        case 64: scores_d<8>(q, K, n, D, scale, s); return;
        case 128: scores_d<16>(q, K, n, D, scale, s); return;
        default: for (long t = 0; t < n; t++) s[t] = dot(q, K + t * D, D) * scale;
    }
}

// acc[D] = sum_t p[t] V[t] over the n rows of V; DV = D / 8 accumulators in registers.
template <int DV>
static void weighted_d(const float* p, const float* V, long n, float* acc) {
    __m256 a[DV];
    for (int i = 0; i < DV; i++) a[i] = _mm256_setzero_ps();
    for (long t = 0; t < n; t++) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int i = 0; i < DV; i++) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(V + t * DV * 8 + 8 * i), a[i]);
    }
    for (int i = 0; i < DV; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

static void weighted(const float* p, const float* V, long n, long D, float* acc) {
    switch (D) {
        case 32: weighted_d<4>(p, V, n, acc); return;
        case 64: weighted_d<8>(p, V, n, acc); return;
        case 128: weighted_d<16>(p, V, n, acc); return;
        default:
            for (long d = 0; d < D; d++) acc[d] = 0.0f;
            for (long t = 0; t < n; t++)
                for (long d = 0; d < D; d++) acc[d] += p[t] * V[t * D + d];
    }
}

// B query tokens against the live columns of their buffer rows, grouped heads (G = H / Hkv query heads
// per K/V head). Query b reads buffer row rowmap[b] (null: row b). q [B, H, D]; the new k, v [B, Hkv, D]
// are written at column lens[b] - 1 of their rows of the buffers kb / vb (row stride rs, head stride hs,
// column stride D); q and the new k are first rotated (RoPE on their first `rot` dims by cos / sin
// [B, rot]) unless cos is null. Query b then attends to its row's first lens[b] columns (several
// queries of one row with consecutive lengths: causal attention among the new tokens). Each (row, K/V head) is split into blocks of CH columns (flash-decoding), every K and V row
// read once for the G query heads: a block leaves per head its max score, sum of exp and exp-weighted
// sum of V; the blocks are then combined. out [B, H, D].
static void attend(const float* q_in, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                   const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                   long Hkv, long D, long rs, long hs, float scale, int threads) {
    const long G = H / Hkv, CH = 128;
    float* q = new float[B * H * D];
    long maxlen = 0;
    for (long b = 0; b < B; b++) {
        maxlen = lens[b] > maxlen ? lens[b] : maxlen;
        for (long h = 0; h < H; h++) {
            float* qh = q + (b * H + h) * D;
            for (long d = 0; d < D; d++) qh[d] = q_in[(b * H + h) * D + d];
            if (cos) rope(qh, cos + b * rot, sin + b * rot, rot);
        }
        const long row = rowmap ? rowmap[b] : b;
        for (long j = 0; j < Hkv; j++) {
            float* kd = kb + row * rs + j * hs + (lens[b] - 1) * D;
            float* vd = vb + row * rs + j * hs + (lens[b] - 1) * D;
            for (long d = 0; d < D; d++) { kd[d] = kn[(b * Hkv + j) * D + d]; vd[d] = vn[(b * Hkv + j) * D + d]; }
            if (cos) rope(kd, cos + b * rot, sin + b * rot, rot);
        }
    }
    const long NC = (maxlen + CH - 1) / CH, W = D + 2;  // scratch per (row, head, block): max, sum, acc[D]
    float* scratch = new float[B * H * NC * W];
    #pragma omp parallel for collapse(3) schedule(dynamic) num_threads(threads)
    for (long b = 0; b < B; b++)
        for (long j = 0; j < Hkv; j++)
            for (long c = 0; c < NC; c++) {
                const long t0 = c * CH, t1 = (t0 + CH < lens[b]) ? t0 + CH : lens[b], n = t1 - t0;
                if (n <= 0) continue;
                const long row = rowmap ? rowmap[b] : b;
                const float* K = kb + row * rs + j * hs + t0 * D;
                const float* V = vb + row * rs + j * hs + t0 * D;
                const float* qj = q + (b * H + j * G) * D;
                float s[G * CH];
                for (long g = 0; g < G; g++) scores(qj + g * D, K, n, D, scale, s + g * CH);
                for (long g = 0; g < G; g++) {
                    float* sg = s + g * CH;
                    float m = -INFINITY;
                    for (long t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
                    long i = 0;
                    __m256 sum8 = _mm256_setzero_ps();
                    for (; i + 8 <= n; i += 8) {
                        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), _mm256_set1_ps(m)));
                        _mm256_storeu_ps(sg + i, e);
                        sum8 = _mm256_add_ps(sum8, e);
                    }
                    float l = hsum(sum8);
                    for (; i < n; i++) { sg[i] = expf(sg[i] - m); l += sg[i]; }
                    float* w = scratch + ((b * H + j * G + g) * NC + c) * W;
                    w[0] = m; w[1] = l;
                    weighted(sg, V, n, D, w + 2);
                }
            }
    #pragma omp parallel for collapse(2) num_threads(threads)
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++) {
            const long nc = (lens[b] + CH - 1) / CH;
            const float* w = scratch + (b * H + h) * NC * W;
            float M = -INFINITY, L = 0.0f;
            for (long c = 0; c < nc; c++) M = w[c * W] > M ? w[c * W] : M;
            float* o = out + (b * H + h) * D;
            for (long d = 0; d < D; d++) o[d] = 0.0f;
            for (long c = 0; c < nc; c++) {
                const float f = expf(w[c * W] - M);
                L += f * w[c * W + 1];
                for (long d = 0; d < D; d++) o[d] += f * w[c * W + 2 + d];
            }
            for (long d = 0; d < D; d++) o[d] /= L;
        }
    delete[] scratch;
    delete[] q;
}

// Bamba's Mamba2 mixer on one token per row, after in_proj. zx [B, I + C + H]: gate [I], xBC [C = I + 2 G N],
// dt [H]. The conv rows conv [B, C, K] shift by one column (the new input last) and give
// silu(depthwise conv + bias); then per head (P channels, group g = h / (H / G)):
//   dt = softplus(dt + dt_bias); S <- exp(dt A) S + dt x B^T; y = S C + D x,
// the state rows S [B, H, P, N] (fp32) advanced in place; y *= silu(gate), normed per group of I / G
// channels (RMS, eps) and scaled by norm_w. out [B, I]. Rows x groups run in parallel.
static void mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                   const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out,
                   long B, long H, long P, long G, long N, long K, int threads) {
    const long I = H * P, C = I + 2 * G * N, HG = H / G, width = I + C + H;
    #pragma omp parallel for collapse(2) num_threads(threads)
    for (long b = 0; b < B; b++)
        for (long g = 0; g < G; g++) {
            const float* row = zx + b * width;
            const float* gate = row;
            const float* xbc = row + I;
            const float* dtr = row + I + C;
            float xs[HG * P], Bs[N], Cs[N];
            // the conv on this group's channels: its heads' x, its B and its C
            auto conv1 = [&](long ch) -> float {
                float* st = conv + (b * C + ch) * K;
                for (long k = 0; k + 1 < K; k++) st[k] = st[k + 1];
                st[K - 1] = xbc[ch];
                float acc = conv_b ? conv_b[ch] : 0.0f;
                for (long k = 0; k < K; k++) acc += st[k] * conv_w[ch * K + k];
                return silu1(acc);
            };
            for (long i = 0; i < HG * P; i++) xs[i] = conv1(g * HG * P + i);
            for (long n = 0; n < N; n++) Bs[n] = conv1(I + g * N + n);
            for (long n = 0; n < N; n++) Cs[n] = conv1(I + G * N + g * N + n);
            float* o = out + b * I + g * HG * P;
            for (long hh = 0; hh < HG; hh++) {
                const long h = g * HG + hh;
                float dt = dtr[h] + dt_bias[h];
                dt = dt > 20.0f ? dt : log1pf(expf(dt));
                const float dA = expf(dt * A[h]);
                float* S = state + (b * H + h) * P * N;
                for (long p = 0; p < P; p++) {
                    const float x = xs[hh * P + p], cx = dt * x;
                    float* Sp = S + p * N;
                    __m256 acc = _mm256_setzero_ps();
                    long n = 0;
                    for (; n + 8 <= N; n += 8) {
                        const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(Sp + n), _mm256_set1_ps(dA),
                                                         _mm256_mul_ps(_mm256_set1_ps(cx), _mm256_loadu_ps(Bs + n)));
                        _mm256_storeu_ps(Sp + n, v);
                        acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(Cs + n), acc);
                    }
                    float y = hsum(acc);
                    for (; n < N; n++) {
                        Sp[n] = Sp[n] * dA + cx * Bs[n];
                        y += Sp[n] * Cs[n];
                    }
                    o[hh * P + p] = (y + Dp[h] * x) * silu1(gate[h * P + p]);
                }
            }
            const long n = HG * P;
            const float inv = 1.0f / sqrtf(dot(o, o, n) / n + eps);
            for (long i = 0; i < n; i++) o[i] = norm_w[g * n + i] * (o[i] * inv);
        }
}

extern "C" {
void hypic_add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n) {
    add_rmsnorm(h, d, w, eps, out, R, n);
}
void hypic_silu_mul(const float* gu, float* out, long R, long n) { silu_mul(gu, out, R, n); }
// Returns 1 (and touches nothing) when a length or row falls outside the buffers' nrows x ncols.
int hypic_attend(const float* q, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                 const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                 long Hkv, long D, long rs, long hs, long nrows, long ncols, float scale, int threads) {
    for (long b = 0; b < B; b++) {
        const long row = rowmap ? rowmap[b] : b;
        if (lens[b] < 1 || lens[b] > ncols || row < 0 || row >= nrows) return 1;
    }
    attend(q, kn, vn, kb, vb, lens, rowmap, cos, sin, rot, out, B, H, Hkv, D, rs, hs, scale, threads);
    return 0;
}
void hypic_mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                  const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out,
                  long B, long H, long P, long G, long N, long K, int threads) {
    mamba2(zx, conv, conv_w, conv_b, dt_bias, A, Dp, state, norm_w, eps, out, B, H, P, G, N, K, threads);
}
void hypic_linear_f32(const float* x, const float* w, const float* bias, float* y, long R, long n, long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads);
}
void hypic_linear_f16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads);
}
void hypic_linear_i8(const float* x, const int8_t* w, const float* scales, const float* bias, float* y, long R, long n,
                     long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads, scales);
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
        P, L, F, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
        signatures = {  # name: (argument types, result type)
            "hypic_linear_f32": ([P] * 4 + [L] * 3 + [I], None),
            "hypic_linear_f16": ([P] * 4 + [L] * 3 + [I], None),
            "hypic_linear_i8": ([P] * 5 + [L] * 3 + [I], None),
            "hypic_add_rmsnorm": ([P, P, P, F, P, L, L], None),
            "hypic_silu_mul": ([P, P, L, L], None),
            "hypic_attend": ([P] * 9 + [L, P] + [L] * 8 + [F, I], I),  # 1: a length or row out of the buffers
            "hypic_mamba2": ([P] * 9 + [F, P] + [L] * 6 + [I], None),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._fns = {torch.float32: self.lib.hypic_linear_f32, torch.float16: self.lib.hypic_linear_f16}

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T * scales (+ bias): W fp32 or fp16, or int8 with its rows' fp32 `scales` [out]."""
        R, n = x.shape
        out = w.shape[0]
        if (x.dtype != torch.float32 or (w.dtype not in self._fns and w.dtype != torch.int8) or w.shape[1] != n
                or x.device.type != "cpu" or not (w.is_contiguous() and x.is_contiguous())):
            raise ValueError(f"linear needs contiguous fp32 x [R, {w.shape[1]}] and fp32/fp16/int8 W [out, in] on the "
                             f"CPU; got x {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous fp32 [{out}], got {bias.dtype} {tuple(bias.shape)}")
        if (w.dtype == torch.int8) != (scales is not None) or (scales is not None and (
                scales.dtype != torch.float32 or scales.shape != (out,) or not scales.is_contiguous())):
            raise ValueError(f"int8 weights need their rows' contiguous fp32 scales [{out}] (and only they take scales)")
        y = torch.empty(R, out, dtype=torch.float32)
        b = bias.data_ptr() if bias is not None else None
        if scales is not None:
            self.lib.hypic_linear_i8(x.data_ptr(), w.data_ptr(), scales.data_ptr(), b, y.data_ptr(), R, n, out,
                                     torch.get_num_threads())
        else:
            self._fns[w.dtype](x.data_ptr(), w.data_ptr(), b, y.data_ptr(), R, n, out, torch.get_num_threads())
        return y


    # --- the step's other ops (fp32, contiguous; the lean step checks what it passes once, at build) ---
    def add_rmsnorm(self, h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """h [R, n] += d (in place, when d is given); returns w * h / sqrt(mean(h^2) + eps), a new [R, n]."""
        out = torch.empty_like(h)
        self.lib.hypic_add_rmsnorm(h.data_ptr(), None if d is None else d.data_ptr(), w.data_ptr(), eps, out.data_ptr(),
                                   h.shape[0], h.shape[1])
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gu[:, :n]) * gu[:, n:] for gu [R, 2n]: a new [R, n]."""
        R, n = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(R, n, dtype=torch.float32)
        self.lib.hypic_silu_mul(gu.data_ptr(), out.data_ptr(), R, n)
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
               lens: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
               sin: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """B query tokens, each of buffer row rows[b] (None: row b): q [B, H, D] and the new k [B, Hkv, D]
        rotated by cos / sin [B, rot] (rotate-half RoPE on their first rot dims; none when cos is None), k
        and v written at column lens[b] - 1 of their rows of the buffers kb / vb [rows, Hkv, cols, D]
        (contiguous), then query b attends to its row's first lens[b] columns (softmax(q K^T * scale) V,
        grouped heads): several tokens of one row with consecutive lengths attend causally. q is not
        changed. Returns [B, H * D]."""
        B, H, D = q.shape
        if not (kb.is_contiguous() and vb.is_contiguous() and kb.dtype == vb.dtype == q.dtype == torch.float32):
            raise ValueError("attend needs fp32 queries and contiguous fp32 K/V row buffers")
        if lens.dtype != torch.long or len(lens) != B or (rows is not None and (rows.dtype != torch.long or len(rows) != B)):
            raise ValueError("attend needs one long length (and row) per query")
        out = torch.empty(B, H * D, dtype=torch.float32)
        rot = 0 if cos is None else cos.shape[-1]
        bad = self.lib.hypic_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), kb.data_ptr(), vb.data_ptr(),
                                    lens.data_ptr(), None if rows is None else rows.data_ptr(),
                                    None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), rot,
                                    out.data_ptr(), B, H, k.shape[1], D, kb.stride(0), kb.stride(1), kb.shape[0],
                                    kb.shape[2], scale, torch.get_num_threads())
        if bad:  # checked in the kernel before it writes: out of the buffers is an error, not memory
            raise ValueError(f"attend: lengths 1..{kb.shape[2]} and rows 0..{kb.shape[0] - 1} of the buffers, one each "
                             f"per query")
        return out

    def mamba2(self, zx: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
               dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, norm_w: torch.Tensor,
               eps: float, heads: int, head_dim: int, groups: int, state_size: int) -> torch.Tensor:
        """Bamba's Mamba2 mixer on one token per row after its in_proj (zx [B, gate | xBC | dt]): the conv rows
        [B, C, K] and state rows [B, H, P, N] (fp32) advance in place; returns the gated, group-normed
        output [B, H * P] for out_proj."""
        B = zx.shape[0]
        if not (conv.is_contiguous() and state.is_contiguous() and conv.dtype == state.dtype == torch.float32):
            raise ValueError("mamba2 needs contiguous fp32 conv and state rows")
        out = torch.empty(B, heads * head_dim, dtype=torch.float32)
        self.lib.hypic_mamba2(zx.data_ptr(), conv.data_ptr(), conv_w.data_ptr(),
                              None if conv_b is None else conv_b.data_ptr(), dt_bias.data_ptr(), A.data_ptr(),
                              D.data_ptr(), state.data_ptr(), norm_w.data_ptr(), eps, out.data_ptr(),
                              B, heads, head_dim, groups, state_size, conv.shape[-1], torch.get_num_threads())
        return out


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of W [out, in]: (q int8 [out, in], scales fp32 [out]) with W ~ q * scales[:, None],
    each row's largest |w| at 127."""
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scales.contiguous()


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch product the kernels compute: x @ (W.float() * scales[:, None])^T (+ bias), fp32."""
    w = w.float() if scales is None else w.float() * scales[:, None]
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())


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
