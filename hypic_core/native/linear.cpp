// Decode-sized matmuls: y [R, out] = x [R, in] @ W^T * scales (+ bias) for a few rows R, W [out, in] fp32,
// fp16, bf16 or int8 (with one fp32 scale per output row, or per group of 32 weights of a row: q8_t). A decode
// step reads every weight once, so these are bound by the bytes they read: each thread (OpenMP) takes a
// contiguous range of W's rows, reads it as 4 sequential streams (one per quarter of the range) and keeps the
// 4 rows in hand while they meet every row of x (3 at a time: 12 accumulators).
#include <omp.h>

#include <type_traits>

#include "hypic_kernels.h"
#include "simd.h"

// Half- and quarter-width weights stream twice or four times as many rows per instruction as fp32 and
// the hardware prefetcher alone fell behind them: a decode step's bf16 matmuls, one after another,
// read 25.6 GB/s where fp32's read 30.4 (the machine's sum bandwidth); a prefetch PREFETCH bytes ahead
// in each of the 4 streams brought bf16 to ~30 and left fp32 where it was (docs/benchmarks.md).
constexpr long PREFETCH = 1024;
template <typename W>
static inline void prefetch_ahead(const W* p) {
    if constexpr (sizeof(W) < 4) __builtin_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, 0, 3);
}

// int8 weights with one scale per HYPIC_Q8_GROUP consecutive weights of a row (llama.cpp's Q8_0 layout, the
// scales apart): a tag type for the templates below, the bytes are int8.
struct q8_t {
    int8_t v;
};

// y[r, o + b * stride] as `block` below, for q8_t weights: each group's products summed on their own, then
// times the group's scale into the row's sum. n is a multiple of the group (the caller checks).
template <int RB, int OB>
static inline void block_q8(const float* x, long ldx, const int8_t* w, long n, float* y, long ldy, long o, long stride,
                            const float* bias, const float* scales) {
    const long groups = n / HYPIC_Q8_GROUP;
    vf acc[RB][OB];
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) acc[r][b] = vzero();
    for (long g = 0; g < groups; g++) {
        const long k0 = g * HYPIC_Q8_GROUP;
        for (int b = 0; b < OB; b++) {
            const long ob = o + b * stride;
            const int8_t* wr = w + ob * n + k0;
            prefetch_ahead(wr);
            vf part[RB];
            for (int r = 0; r < RB; r++) part[r] = vzero();
            for (long k = 0; k < HYPIC_Q8_GROUP; k += VL) {
                const vf wv = vload(wr + k);
                for (int r = 0; r < RB; r++) part[r] = vfmadd(vload(x + r * ldx + k0 + k), wv, part[r]);
            }
            const vf s = vset1(scales[ob * groups + g]);
            for (int r = 0; r < RB; r++) acc[r][b] = vfmadd(part[r], s, acc[r][b]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) {
            const long ob = o + b * stride;
            y[r * ldy + ob] = vhsum(acc[r][b]) + (bias ? bias[ob] : 0.0f);
        }
}

#if defined(HYPIC_AVX512BF16)
// bf16 weights on AVX512-BF16 (vdpbf16ps): 32 weights per instruction, x rounded to bf16 (to nearest even)
// 32 at a time as the weights are, products summed in fp32; the tail (n % 32) widens exactly, as elsewhere.
template <int RB, int OB>
static inline void block_dpbf16(const float* x, long ldx, const bf16_t* w, long n, float* y, long ldy, long o,
                                long stride, const float* bias) {
    __m512 acc[RB][OB];
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) acc[r][b] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512bh xv[RB];
        for (int r = 0; r < RB; r++) xv[r] = _mm512_cvtne2ps_pbh(vload(x + r * ldx + k + 16), vload(x + r * ldx + k));
        for (int b = 0; b < OB; b++) {
            prefetch_ahead(w + (o + b * stride) * n + k);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (o + b * stride) * n + k);
            for (int r = 0; r < RB; r++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv[r], wv);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < OB; b++) {
            const long ob = o + b * stride;
            float s = vhsum(acc[r][b]);
            for (long t = k; t < n; t++) s += x[r * ldx + t] * load1(w + ob * n + t);
            y[r * ldy + ob] = s + (bias ? bias[ob] : 0.0f);
        }
}
#endif

// y[r, o + b * stride] for r < RB, b < OB: dot products of RB rows of x with OB rows of w (length n),
// the rows of w `stride` apart, each times its row's scale (int8 weights; null: 1) plus its bias.
template <int RB, int OB, typename W>
static inline void block(const float* x, long ldx, const W* w, long n, float* y, long ldy, long o, long stride,
                         const float* bias, const float* scales) {
    if constexpr (std::is_same_v<W, q8_t>) {
        block_q8<RB, OB>(x, ldx, reinterpret_cast<const int8_t*>(w), n, y, ldy, o, stride, bias, scales);
    } else {
#if defined(HYPIC_AVX512BF16)
        if constexpr (std::is_same_v<W, bf16_t>) {
            block_dpbf16<RB, OB>(x, ldx, w, n, y, ldy, o, stride, bias);
            return;
        }
#endif
        vf acc[RB][OB];
        for (int r = 0; r < RB; r++)
            for (int b = 0; b < OB; b++) acc[r][b] = vzero();
        long k = 0;
        for (; k + VL <= n; k += VL) {
            vf xv[RB];
            for (int r = 0; r < RB; r++) xv[r] = vload(x + r * ldx + k);
            for (int b = 0; b < OB; b++) {
                prefetch_ahead(w + (o + b * stride) * n + k);
                const vf wv = vload(w + (o + b * stride) * n + k);
                for (int r = 0; r < RB; r++) acc[r][b] = vfmadd(xv[r], wv, acc[r][b]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int b = 0; b < OB; b++) {
                const long ob = o + b * stride;
                float s = vhsum(acc[r][b]);
                for (long t = k; t < n; t++) s += x[r * ldx + t] * load1(w + ob * n + t);
                y[r * ldy + ob] = (scales ? s * scales[ob] : s) + (bias ? bias[ob] : 0.0f);
            }
    }
}

// Every row of x (3 at a time) against the OB rows of w at o, o + stride, ...
template <int OB, typename W>
static inline void rows(const float* x, long R, long n, const W* w, float* y, long ldy, long o, long stride,
                        const float* bias, const float* scales) {
    long r = 0;
    for (; r + 3 <= R; r += 3) block<3, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
    if (R - r == 2) block<2, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
    if (R - r == 1) block<1, OB>(x + r * n, n, w, n, y + r * ldy, ldy, o, stride, bias, scales);
}

// 4 long streams per thread keep more memory requests in flight than one, and than 4 adjacent rows
// (short streams of a few KB) did.
template <typename W>
static void linear(const float* x, const W* w, const float* bias, float* y, long R, long n, long out, int threads,
                   const float* scales) {
    #pragma omp parallel num_threads(threads)
    {
        const long nt = omp_get_num_threads(), t = omp_get_thread_num();
        const long t0 = out * t / nt, t1 = out * (t + 1) / nt, q = (t1 - t0) / 4;
        for (long j = 0; j < q; j++) rows<4>(x, R, n, w, y, out, t0 + j, q, bias, scales);
        for (long o = t0 + 4 * q; o < t1; o++) rows<1>(x, R, n, w, y, out, o, 1, bias, scales);
    }
}

extern "C" {
void hypic_linear_f32(const float* x, const float* w, const float* bias, float* y, long R, long n, long out,
                      int threads) {
    linear(x, w, bias, y, R, n, out, threads, nullptr);
}
void hypic_linear_f16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out,
                      int threads) {
    linear(x, w, bias, y, R, n, out, threads, nullptr);
}
void hypic_linear_bf16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out,
                       int threads) {
    linear(x, reinterpret_cast<const bf16_t*>(w), bias, y, R, n, out, threads, nullptr);
}
void hypic_linear_i8(const float* x, const int8_t* w, const float* scales, const float* bias, float* y, long R,
                     long n, long out, int threads) {
    linear(x, w, bias, y, R, n, out, threads, scales);
}
void hypic_linear_q8(const float* x, const int8_t* w, const float* scales, const float* bias, float* y, long R,
                     long n, long out, int threads) {
    linear(x, reinterpret_cast<const q8_t*>(w), bias, y, R, n, out, threads, scales);
}
}

// blocks.cpp's matmuls: the weight's type as a code (hypic_kernels.h HYPIC_W_*).
void linear_typed(int wtype, const float* x, const void* w, const float* scales, const float* bias, float* y, long R,
                  long n, long out, int threads) {
    switch (wtype) {
        case HYPIC_W_F32: linear(x, static_cast<const float*>(w), bias, y, R, n, out, threads, nullptr); break;
        case HYPIC_W_F16: linear(x, static_cast<const uint16_t*>(w), bias, y, R, n, out, threads, nullptr); break;
        case HYPIC_W_BF16: linear(x, static_cast<const bf16_t*>(w), bias, y, R, n, out, threads, nullptr); break;
        case HYPIC_W_Q8: linear(x, static_cast<const q8_t*>(w), bias, y, R, n, out, threads, scales); break;
        default: linear(x, static_cast<const int8_t*>(w), bias, y, R, n, out, threads, scales); break;
    }
}
