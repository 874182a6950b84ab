// The decode step's other fp32 ops, each one call where torch runs 5-30 small ones: the residual add with
// its RMS norm, the MLP's gate, one attention layer (RoPE, the new K/V written into their rows, grouped
// heads, flash-decoding blocks) and one Mamba2 mixer between its projections.
// tests/engine/test_decode_ops.py holds each to the torch code it replaces.
#include <omp.h>

#include <vector>

#include "hypic_kernels.h"
#include "simd.h"

#if defined(HYPIC_VARIANT)
#define HYPIC_STR2(x) #x
#define HYPIC_STR(x) HYPIC_STR2(x)
static const char kVariant[] = HYPIC_STR(HYPIC_VARIANT);
#else
static const char kVariant[] = "unnamed";
#endif

// h [R, n] += d (when d is not null); out = w * h / sqrt(mean(h^2) + eps), row by row.
static void add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n) {
    for (long r = 0; r < R; r++) {
        float* hr = h + r * n;
        if (d)
            for (long i = 0; i < n; i++) hr[i] += d[r * n + i];
        const float inv = 1.0f / std::sqrt(dot(hr, hr, n) / n + eps);
        for (long i = 0; i < n; i++) out[r * n + i] = w[i] * (hr[i] * inv);
    }
}

// out [R, n] = silu(gu[:, :n]) * gu[:, n:], gu [R, 2n].
static void silu_mul(const float* gu, float* out, long R, long n) {
    for (long r = 0; r < R; r++) {
        const float* g = gu + r * 2 * n;
        const float* u = g + n;
        long i = 0;
        for (; i + VL <= n; i += VL) {
            const vf x = vload(g + i);
            const vf s = vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x))));
            vstore(out + r * n + i, vmul(s, vload(u + i)));
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

// s[t] = scale * q . K[t] for the n rows of K (D = DV * VL floats each), 4 rows at a time, q in registers.
template <int DV>
static void scores_d(const float* q, const float* K, long n, long D, float scale, float* s) {
    vf qv[DV];
    for (int i = 0; i < DV; i++) qv[i] = vload(q + VL * i);
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        const float* k = K + t * D;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int i = 0; i < DV; i++) {
            a0 = vfmadd(qv[i], vload(k + VL * i), a0);
            a1 = vfmadd(qv[i], vload(k + D + VL * i), a1);
            a2 = vfmadd(qv[i], vload(k + 2 * D + VL * i), a2);
            a3 = vfmadd(qv[i], vload(k + 3 * D + VL * i), a3);
        }
        s[t] = vhsum(a0) * scale;
        s[t + 1] = vhsum(a1) * scale;
        s[t + 2] = vhsum(a2) * scale;
        s[t + 3] = vhsum(a3) * scale;
    }
    for (; t < n; t++) s[t] = dot(q, K + t * D, D) * scale;
}

// acc[D] = sum_t p[t] V[t] over the n rows of V (D = DV * VL), the accumulators in registers.
template <int DV>
static void weighted_d(const float* p, const float* V, long n, float* acc) {
    vf a[DV];
    for (int i = 0; i < DV; i++) a[i] = vzero();
    for (long t = 0; t < n; t++) {
        const vf pt = vset1(p[t]);
        for (int i = 0; i < DV; i++) a[i] = vfmadd(pt, vload(V + t * DV * VL + VL * i), a[i]);
    }
    for (int i = 0; i < DV; i++) vstore(acc + VL * i, a[i]);
}

// Head sizes with a register-resident path: D / VL in {2, 4, 8, 16} (32..256 on AVX-512); others, and the
// generic variant, take the plain loops.
static void scores(const float* q, const float* K, long n, long D, float scale, float* s) {
    switch (VL > 1 && D % VL == 0 ? D / VL : 0) {
        case 2: scores_d<2>(q, K, n, D, scale, s); return;
        case 4: scores_d<4>(q, K, n, D, scale, s); return;
        case 8: scores_d<8>(q, K, n, D, scale, s); return;
        case 16: scores_d<16>(q, K, n, D, scale, s); return;
        default:
            for (long t = 0; t < n; t++) s[t] = dot(q, K + t * D, D) * scale;
    }
}

static void weighted(const float* p, const float* V, long n, long D, float* acc) {
    switch (VL > 1 && D % VL == 0 ? D / VL : 0) {
        case 2: weighted_d<2>(p, V, n, acc); return;
        case 4: weighted_d<4>(p, V, n, acc); return;
        case 8: weighted_d<8>(p, V, n, acc); return;
        case 16: weighted_d<16>(p, V, n, acc); return;
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
// [B, rot]) unless cos is null. Query b then attends to its row's first lens[b] columns (several queries
// of one row with consecutive lengths: causal attention among the new tokens). Each (row, K/V head) is
// split into blocks of CH columns (flash-decoding), every K and V row read once for the G query heads: a
// block leaves per head its max score, sum of exp and exp-weighted sum of V; the blocks are then
// combined. out [B, H, D].
static void attend(const float* q_in, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                   const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                   long Hkv, long D, long rs, long hs, float scale, int threads) {
    const long G = H / Hkv, CH = 128;
    std::vector<float> q(static_cast<size_t>(B * H * D));
    long maxlen = 0;
    for (long b = 0; b < B; b++) {
        maxlen = lens[b] > maxlen ? lens[b] : maxlen;
        for (long h = 0; h < H; h++) {
            float* qh = q.data() + (b * H + h) * D;
            for (long d = 0; d < D; d++) qh[d] = q_in[(b * H + h) * D + d];
            if (cos) rope(qh, cos + b * rot, sin + b * rot, rot);
        }
        const long row = rowmap ? rowmap[b] : b;
        for (long j = 0; j < Hkv; j++) {
            float* kd = kb + row * rs + j * hs + (lens[b] - 1) * D;
            float* vd = vb + row * rs + j * hs + (lens[b] - 1) * D;
            for (long d = 0; d < D; d++) {
                kd[d] = kn[(b * Hkv + j) * D + d];
                vd[d] = vn[(b * Hkv + j) * D + d];
            }
            if (cos) rope(kd, cos + b * rot, sin + b * rot, rot);
        }
    }
    const long NC = (maxlen + CH - 1) / CH, W = D + 2;  // scratch per (row, head, block): max, sum, acc[D]
    std::vector<float> scratch(static_cast<size_t>(B * H * NC * W));
    #pragma omp parallel num_threads(threads)
    {
        std::vector<float> sbuf(static_cast<size_t>(G * CH));  // this thread's scores, G heads x one block
        #pragma omp for collapse(3) schedule(dynamic)
        for (long b = 0; b < B; b++)
            for (long j = 0; j < Hkv; j++)
                for (long c = 0; c < NC; c++) {
                    const long t0 = c * CH, t1 = (t0 + CH < lens[b]) ? t0 + CH : lens[b], n = t1 - t0;
                    if (n <= 0) continue;
                    const long row = rowmap ? rowmap[b] : b;
                    const float* K = kb + row * rs + j * hs + t0 * D;
                    const float* V = vb + row * rs + j * hs + t0 * D;
                    const float* qj = q.data() + (b * H + j * G) * D;
                    float* s = sbuf.data();
                    for (long g = 0; g < G; g++) scores(qj + g * D, K, n, D, scale, s + g * CH);
                    for (long g = 0; g < G; g++) {
                        float* sg = s + g * CH;
                        float m = -INFINITY;
                        for (long t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
                        long i = 0;
                        vf sumv = vzero();
                        for (; i + VL <= n; i += VL) {
                            const vf e = vexp(vsub(vload(sg + i), vset1(m)));
                            vstore(sg + i, e);
                            sumv = vadd(sumv, e);
                        }
                        float l = vhsum(sumv);
                        for (; i < n; i++) {
                            sg[i] = std::exp(sg[i] - m);
                            l += sg[i];
                        }
                        float* w = scratch.data() + ((b * H + j * G + g) * NC + c) * W;
                        w[0] = m;
                        w[1] = l;
                        weighted(sg, V, n, D, w + 2);
                    }
                }
    }
    #pragma omp parallel for collapse(2) num_threads(threads)
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++) {
            const long nc = (lens[b] + CH - 1) / CH;
            const float* w = scratch.data() + (b * H + h) * NC * W;
            float M = -INFINITY, L = 0.0f;
            for (long c = 0; c < nc; c++) M = w[c * W] > M ? w[c * W] : M;
            float* o = out + (b * H + h) * D;
            for (long d = 0; d < D; d++) o[d] = 0.0f;
            for (long c = 0; c < nc; c++) {
                const float f = std::exp(w[c * W] - M);
                L += f * w[c * W + 1];
                for (long d = 0; d < D; d++) o[d] += f * w[c * W + 2 + d];
            }
            for (long d = 0; d < D; d++) o[d] /= L;
        }
}

// Bamba's Mamba2 mixer on one token per row, after in_proj. zx [B, I + C + H]: gate [I], xBC [C = I + 2 G N],
// dt [H]. The conv rows conv [B, C, K] shift by one column (the new input last) and give
// silu(depthwise conv + bias); then per head (P channels, group g = h / (H / G)):
//   dt = softplus(dt + dt_bias); S <- exp(dt A) S + dt x B^T; y = S C + D x,
// the state rows S [B, H, P, N] (fp32) advanced in place; y *= silu(gate), normed per group of I / G
// channels (RMS, eps) and scaled by norm_w. out [B, I]. Rows x groups run in parallel.
static void mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                   const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out, long B,
                   long H, long P, long G, long N, long K, int threads) {
    const long I = H * P, C = I + 2 * G * N, HG = H / G, width = I + C + H;
    #pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf(static_cast<size_t>(HG * P + 2 * N));  // this thread's x, B and C of one group
        float* xs = buf.data();
        float* Bs = xs + HG * P;
        float* Cs = Bs + N;
        #pragma omp for collapse(2)
        for (long b = 0; b < B; b++)
            for (long g = 0; g < G; g++) {
                const float* row = zx + b * width;
                const float* gate = row;
                const float* xbc = row + I;
                const float* dtr = row + I + C;
                auto conv1 = [&](long ch) -> float {  // the conv on one channel: shift in the new input
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
                    dt = dt > 20.0f ? dt : std::log1p(std::exp(dt));
                    const float dA = std::exp(dt * A[h]);
                    float* S = state + (b * H + h) * P * N;
                    for (long p = 0; p < P; p++) {
                        const float x = xs[hh * P + p], cx = dt * x;
                        float* Sp = S + p * N;
                        vf acc = vzero();
                        long n = 0;
                        for (; n + VL <= N; n += VL) {
                            const vf v = vfmadd(vload(Sp + n), vset1(dA), vmul(vset1(cx), vload(Bs + n)));
                            vstore(Sp + n, v);
                            acc = vfmadd(v, vload(Cs + n), acc);
                        }
                        float y = vhsum(acc);
                        for (; n < N; n++) {
                            Sp[n] = Sp[n] * dA + cx * Bs[n];
                            y += Sp[n] * Cs[n];
                        }
                        o[hh * P + p] = (y + Dp[h] * x) * silu1(gate[h * P + p]);
                    }
                }
                const long n = HG * P;
                const float inv = 1.0f / std::sqrt(dot(o, o, n) / n + eps);
                for (long i = 0; i < n; i++) o[i] = norm_w[g * n + i] * (o[i] * inv);
            }
    }
}

bool attend_out_of_buffers(const long* lens, const long* rowmap, long B, long nrows, long ncols) {
    for (long b = 0; b < B; b++) {
        const long row = rowmap ? rowmap[b] : b;
        if (lens[b] < 1 || lens[b] > ncols || row < 0 || row >= nrows) return true;
    }
    return false;
}

extern "C" {
int hypic_kernels_abi(void) { return HYPIC_KERNELS_ABI; }
const char* hypic_kernels_variant(void) { return kVariant; }

void hypic_add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n) {
    add_rmsnorm(h, d, w, eps, out, R, n);
}
void hypic_silu_mul(const float* gu, float* out, long R, long n) { silu_mul(gu, out, R, n); }
int hypic_attend(const float* q, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                 const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                 long Hkv, long D, long rs, long hs, long nrows, long ncols, float scale, int threads) {
    if (attend_out_of_buffers(lens, rowmap, B, nrows, ncols)) return 1;
    attend(q, kn, vn, kb, vb, lens, rowmap, cos, sin, rot, out, B, H, Hkv, D, rs, hs, scale, threads);
    return 0;
}
void hypic_mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                  const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out, long B,
                  long H, long P, long G, long N, long K, int threads) {
    mamba2(zx, conv, conv_w, conv_b, dt_bias, A, Dp, state, norm_w, eps, out, B, H, P, G, N, K, threads);
}
}
