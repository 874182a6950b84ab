// A decode layer's parts as one call each: the residual add and RMS norm, then the part's matmuls and the
// op between them, run one after another in C++ (the same functions the single-op entries run, in the same
// order, so a block's result is the ops' bit for bit). What a block saves is the calls: from Python, each
// op's call costs ~10 us inside a decode step (every cache has just been flushed by the weights streaming
// through), about as much as the op itself; a step of the hybrid made ~240 of them.
// tests/engine/test_decode_ops.py holds each block to the ops it replaces.
#include <vector>

#include "hypic_kernels.h"

namespace {

// The calling thread's scratch (the step calls from one thread at a time; each block uses its own slots).
float* scratch(int slot, long n) {
    thread_local std::vector<float> bufs[4];
    std::vector<float>& b = bufs[slot];
    if (static_cast<long>(b.size()) < n) b.resize(n);
    return b.data();
}

}  // namespace

extern "C" {
void hypic_mlp_block(float* h, const float* d, const float* norm_w, float eps, const void* gu, const float* gu_s,
                     const float* gu_b, const void* down, const float* down_s, const float* down_b, int wtype,
                     float* out, long R, long n, long I, int threads) {
    float* x = scratch(0, R * n);
    float* g = scratch(1, R * 2 * I);
    float* a = scratch(2, R * I);
    hypic_add_rmsnorm(h, d, norm_w, eps, x, R, n);
    linear_typed(wtype, x, gu, gu_s, gu_b, g, R, n, 2 * I, threads);
    hypic_silu_mul(g, a, R, I);
    linear_typed(wtype, a, down, down_s, down_b, out, R, I, n, threads);
}

void hypic_norm_linear(float* h, const float* d, const float* norm_w, float eps, const void* w, const float* w_s,
                       const float* w_b, int wtype, float* out, long R, long n, long out_n, int threads) {
    float* x = scratch(0, R * n);
    hypic_add_rmsnorm(h, d, norm_w, eps, x, R, n);
    linear_typed(wtype, x, w, w_s, w_b, out, R, n, out_n, threads);
}

void hypic_mamba2_block(float* h, const float* d, const float* norm_w, float eps, const void* in_w, const float* in_s,
                        const float* in_b, const void* out_w, const float* out_s, const float* out_b, int wtype,
                        long zx_n, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                        const float* A, const float* Dp, float* state, const float* gnorm_w, float gnorm_eps,
                        float* out, long R, long n, long H, long P, long G, long N, long K, int threads) {
    float* x = scratch(0, R * n);
    float* zx = scratch(1, R * zx_n);
    float* y = scratch(2, R * H * P);
    hypic_add_rmsnorm(h, d, norm_w, eps, x, R, n);
    linear_typed(wtype, x, in_w, in_s, in_b, zx, R, n, zx_n, threads);
    hypic_mamba2(zx, conv, conv_w, conv_b, dt_bias, A, Dp, state, gnorm_w, gnorm_eps, y, R, H, P, G, N, K, threads);
    linear_typed(wtype, y, out_w, out_s, out_b, out, R, H * P, n, threads);
}

int hypic_attention_block(float* h, const float* d, const float* norm_w, float eps, const void* qkv_w,
                          const float* qkv_s, const float* qkv_b, const void* o_w, const float* o_s, const float* o_b,
                          int wtype, float* kb, float* vb, const long* lens, const long* rowmap, const float* cos,
                          const float* sin, long rot, float* out, long R, long n, long H, long Hkv, long D, long rs,
                          long hs, long nrows, long ncols, float scale, int threads) {
    if (attend_out_of_buffers(lens, rowmap, R, nrows, ncols)) return 1;  // before anything is written (h included)
    const long nq = H * D, nkv = Hkv * D, width = nq + 2 * nkv;
    float* x = scratch(0, R * n);
    float* qkv = scratch(1, R * width);
    float* qkv_split = scratch(2, R * width);  // [q of every row | k of every row | v of every row]
    float* att = scratch(3, R * nq);
    hypic_add_rmsnorm(h, d, norm_w, eps, x, R, n);
    linear_typed(wtype, x, qkv_w, qkv_s, qkv_b, qkv, R, n, width, threads);
    float* q = qkv_split;
    float* k = q + R * nq;
    float* v = k + R * nkv;
    for (long r = 0; r < R; r++)
        for (long i = 0; i < width; i++) {
            const float val = qkv[r * width + i];
            if (i < nq) q[r * nq + i] = val;
            else if (i < nq + nkv) k[r * nkv + i - nq] = val;
            else v[r * nkv + i - nq - nkv] = val;
        }
    hypic_attend(q, k, v, kb, vb, lens, rowmap, cos, sin, rot, att, R, H, Hkv, D, rs, hs, nrows, ncols, scale, threads);
    linear_typed(wtype, att, o_w, o_s, o_b, out, R, nq, n, threads);
    return 0;
}
}
