// The library's C interface, called through ctypes (hypic_core/native/library.py holds the same
// table of signatures and checks every symbol is there before the first call). Shapes and strides are
// in elements; `threads` is the OpenMP team size (torch's thread count).
#pragma once

#include <cstdint>

#define HYPIC_KERNELS_ABI 2  // bumped whenever a signature below changes

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

void hypic_add_rmsnorm(float* h, const float* d, const float* w, float eps, float* out, long R, long n);
void hypic_silu_mul(const float* gu, float* out, long R, long n);
// Returns 1 (and touches nothing) when a length or row falls outside the buffers' nrows x ncols.
int hypic_attend(const float* q, const float* kn, const float* vn, float* kb, float* vb, const long* lens,
                 const long* rowmap, const float* cos, const float* sin, long rot, float* out, long B, long H,
                 long Hkv, long D, long rs, long hs, long nrows, long ncols, float scale, int threads);
void hypic_mamba2(const float* zx, float* conv, const float* conv_w, const float* conv_b, const float* dt_bias,
                  const float* A, const float* Dp, float* state, const float* norm_w, float eps, float* out, long B,
                  long H, long P, long G, long N, long K, int threads);
}
