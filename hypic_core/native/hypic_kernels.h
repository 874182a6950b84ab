// The library's C interface, called through ctypes (hypic_core/native/library.py holds the same
// table of signatures and checks every symbol is there before the first call). Shapes and strides are
// in elements; `threads` is the OpenMP team size (torch's thread count).
#pragma once

#include <cstdint>

#define HYPIC_KERNELS_ABI 4  // bumped whenever a signature below changes

// A weight's type where one entry takes any (the blocks): fp32, fp16, bf16, int8 with fp32 row scales, or
// int8 with one fp32 scale per group of HYPIC_Q8_GROUP consecutive weights of a row (scales [out, in / 32]).
#define HYPIC_W_F32 0
#define HYPIC_W_F16 1
#define HYPIC_W_BF16 2
#define HYPIC_W_I8 3
#define HYPIC_W_Q8 4
#define HYPIC_Q8_GROUP 32

extern "C" {
int hypic_kernels_abi(void);
const char* hypic_kernels_variant(void);  // the ISA variant this library was built for

void hypic_linear_f32(const float* x, const float* w, const float* bias, float* y, long R, long n, long out,
                      int threads);
void hypic_linear_f16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out,
                      int threads);
void hypic_linear_bf16(const float* x, const uint16_t* w, const float* bias, float* y, long R, long n, long out,
                       int threads);
void hypic_linear_i8(const float* x, const int8_t* w, const float* scales, const float* bias, float* y, long R,
                     long n, long out, int threads);
// int8 with group scales [out, n / HYPIC_Q8_GROUP]; n a multiple of HYPIC_Q8_GROUP.
void hypic_linear_q8(const float* x, const int8_t* w, const float* scales, const float* bias, float* y, long R,
                     long n, long out, int threads);

void hypic_add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n);
void hypic_silu_mul(const float* gu, float* out, long R, long n);
// Returns 1 (and touches nothing) when a length or row falls outside the buffers' nrows x ncols.
int hypic_attend(const float* q, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                 const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                 long Hkv, long D, long rs, long hs, long nrows, long ncols, float scale, int threads);
void hypic_mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                  const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out, long B,
                  long H, long P, long G, long N, long K, int threads);

// Blocks (blocks.cpp): a layer's part from the residual stream h [R, n] to its output, one call where the
// ops above took four to six: h += d (d may be null), x = rmsnorm(h) * norm_w, then the part on x. A
// weight is (w, wtype, scales: int8 only, per row or per group, bias: may be null).
// MLP: out [R, n] = down(silu(gate(x)) * up(x)), gate_up [2I, n], down [n, I].
void hypic_mlp_block(float* h, const float* d, const float* norm_w, float eps, const void* gu, const float* gu_s,
                     const float* gu_b, const void* down, const float* down_s, const float* down_b, int wtype,
                     float* out, long R, long n, long I, int threads);
// A linear on the normed stream: out [R, out_n] = W x (the lm_head after the final norm).
void hypic_norm_linear(float* h, const float* d, const float* norm_w, float eps, const void* w, const float* w_s,
                       const float* w_b, int wtype, float* out, long R, long n, long out_n, int threads);
// Mamba2 between in_proj [zx_n, n] and out_proj [n, H * P] (hypic_mamba2 in between); conv and state advance.
void hypic_mamba2_block(float* h, const float* d, const float* norm_w, float eps, const void* in_w, const float* in_s,
                        const float* in_b, const void* out_w, const float* out_s, const float* out_b, int wtype,
                        long zx_n, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                        const float* A, const float* Dp, float* state, const float* gnorm_w, float gnorm_eps,
                        float* out, long R, long n, long H, long P, long G, long N, long K, int threads);
// Attention (no output gate, no q / k norms): qkv [(H + 2 Hkv) D, n], then hypic_attend's work, then o [n, H D].
// Returns 1 (and touches no buffer) when a length or row falls outside them, as hypic_attend.
int hypic_attention_block(float* h, const float* d, const float* norm_w, float eps, const void* qkv_w,
                          const float* qkv_s, const float* qkv_b, const void* o_w, const float* o_s, const float* o_b,
                          int wtype, float* kb, float* vb, const long* lens, const long* rowmap, const float* cos,
                          const float* sin, long rot, float* out, long R, long n, long H, long Hkv, long D, long rs,
                          long hs, long nrows, long ncols, float scale, int threads);
}

// Within the library: linear.cpp's matmul on a weight of type `wtype`.
void linear_typed(int wtype, const float* x, const void* w, const float* scales, const float* bias, float* y, long R,
                  long n, long out, int threads);
// ops.cpp: whether a query's length (1..ncols) or buffer row (0..nrows-1; rowmap null: row b) falls outside
// the K/V buffers (hypic_attend's check, and the attention block's before it writes anything).
bool attend_out_of_buffers(const long* lens, const long* rowmap, long B, long nrows, long ncols);
