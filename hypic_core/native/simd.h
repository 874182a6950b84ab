// One vector type per ISA variant, so every kernel is written once (ggml-cpu's way): the build defines
// HYPIC_AVX512 (AVX-512 F/BW/VL, 16 lanes), HYPIC_AVX2 (AVX2 + FMA + F16C, 8 lanes) or neither (the
// generic variant: plain C++ on one lane, any CPU the compiler targets). `vf` is VL floats; loads
// widen fp32, fp16, bf16 and int8 weights to fp32 (exactly: a weight's value never changes).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct bf16_t {  // a bfloat16's bits: the top half of an fp32
    uint16_t bits;
};

static inline float half_to_float(uint16_t h) {  // IEEE binary16 -> fp32, exact (subnormals, inf, nan)
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) {  // subnormal: normalize
        int e = -1;
        do { e++; mant <<= 1; } while (!(mant & 0x400u));
        bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return half_to_float(*p); }
static inline float load1(const bf16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(p->bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float load1(const int8_t* p) { return static_cast<float>(*p); }

#if defined(HYPIC_AVX512)
#include <immintrin.h>
typedef __m512 vf;
enum { VL = 16 };
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline vf vload(const bf16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
static inline vf vload(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) {  // 2^n for integral n in the normal range
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
static inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(HYPIC_AVX2)
#include <immintrin.h>
typedef __m256 vf;
enum { VL = 8 };
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline vf vload(const bf16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline vf vload(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
typedef float vf;
enum { VL = 1 };
static inline vf vzero() { return 0.0f; }
static inline vf vset1(float a) { return a; }
template <typename W> static inline vf vload(const W* p) { return load1(p); }
static inline void vstore(float* p, vf v) { *p = v; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vmin(vf a, vf b) { return a < b ? a : b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline vf vfmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf vfnmadd(vf a, vf b, vf c) { return c - a * b; }
static inline vf vround(vf a) { return std::nearbyint(a); }
static inline vf vpow2i(vf n) { return std::ldexp(1.0f, static_cast<int>(n)); }
static inline float vhsum(vf v) { return v; }
#endif

// exp on VL lanes (Cephes' polynomial on x - n ln2; relative error ~2e-7), for x >= -87 (smaller: ~0).
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    const vf fx = vround(vmul(x, vset1(1.44269504088896341f)));
    x = vfnmadd(fx, vset1(0.693359375f), x);
    x = vfnmadd(fx, vset1(-2.12194440e-4f), x);
    vf y = vset1(1.9875691500e-4f);
    y = vfmadd(y, x, vset1(1.3981999507e-3f));
    y = vfmadd(y, x, vset1(8.3334519073e-3f));
    y = vfmadd(y, x, vset1(4.1665795894e-2f));
    y = vfmadd(y, x, vset1(1.6666665459e-1f));
    y = vfmadd(y, x, vset1(5.0000001201e-1f));
    y = vfmadd(y, vmul(x, x), vadd(x, vset1(1.0f)));
    return vmul(y, vpow2i(fx));
}

static inline float dot(const float* a, const float* b, long n) {
    vf acc = vzero();
    long i = 0;
    for (; i + VL <= n; i += VL) acc = vfmadd(vload(a + i), vload(b + i), acc);
    float s = vhsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float silu1(float x) { return x / (1.0f + std::exp(-x)); }
