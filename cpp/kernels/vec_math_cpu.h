// Float32 math for the CPU kernels, eight lanes at a time with AVX2 + FMA:
// exp, sigmoid, erf and the activations built on them, hard-sigmoid / hard-swish, plus horizontal
// reductions. The portable code uses libm (std::exp, std::erf) instead.
// Internal to cpp/kernels/.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#define MLXD_CPU_X86 1
#define MLXD_AVX2 __attribute__((target("avx2,fma")))

namespace mlxd::rt::vmath {

MLXD_AVX2 inline __m256 set1(float v) { return _mm256_set1_ps(v); }

// Eight inputs at stride S from p (S = 2 reads p[0..15] and keeps the even ones).
template <int S>
MLXD_AVX2 inline __m256 load_strided(const float* p) {
  if constexpr (S == 1) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256 even = _mm256_shuffle_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), 0x88);  // a0 a2 b0 b2 | a4 a6 b4 b6
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8));
  }
}

// exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in
// two so r stays exact) and e^r by a degree-7 polynomial (Cephes expf
// coefficients): within 2 ulp of libm. Overflow gives inf, underflow below
// FLT_MIN gives 0 (no denormals), NaN stays NaN.
// The reduction and polynomial alone, for xc already inside [-87.34, 88.72]
// (no clamp, no edge blends). 2^n as 2 * 2^(n-1): n reaches 128 at the top of
// the range, whose exponent field would overflow; n = -126 (the bottom) gives
// a zero field, i.e. 0.
MLXD_AVX2 inline __m256 exp8_core(__m256 xc) {
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, set1(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  __m256 p = set1(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, set1(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, set1(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, set1(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, set1(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, set1(5.0000001201e-1f));
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), set1(1.f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), set1(2.f));
}

MLXD_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 hi = set1(88.7228394f), lo = set1(-87.3365448f);
  __m256 y = exp8_core(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
  y = _mm256_blendv_ps(y, set1(__builtin_inff()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// x / (1 + exp(-x)): sigmoid(x) * x without rounding sigmoid first (torch's form).
MLXD_AVX2 inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(set1(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

MLXD_AVX2 inline __m256 sigmoid8(__m256 x) {
  return _mm256_div_ps(set1(1.f), _mm256_add_ps(set1(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// erf's rational approximation (numerator and denominator in x^2, highest power first),
// shared by every vector width.
constexpr float kErfP[7] = {-2.72614225801306e-10f, 2.77068142495902e-08f, -2.10102402082508e-06f, -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f, -1.60960333262415e-02f};
constexpr float kErfQ[5] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f, -7.37332916720468e-03f, -1.42647390514189e-02f};

// erf(x) as x * P(x^2) / Q(x^2) on x clamped to [-4, 4] (erf is 1 to float
// precision beyond): the rational approximation XLA and Eigen use for float,
// within 4e-7 of libm's erf.
MLXD_AVX2 inline __m256 erf8(__m256 x) {
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x, set1(-4.f)), set1(4.f));
  __m256 x2 = _mm256_mul_ps(xc, xc);
  __m256 p = set1(kErfP[0]), q = set1(kErfQ[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, x2, set1(kErfP[i]));
  for (int i = 1; i < 5; ++i) q = _mm256_fmadd_ps(q, x2, set1(kErfQ[i]));
  __m256 y = _mm256_div_ps(_mm256_mul_ps(xc, p), q);
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// 0.5 x (1 + erf(x / sqrt 2))
MLXD_AVX2 inline __m256 gelu_erf8(__m256 x) {
  __m256 half_x = _mm256_mul_ps(x, set1(0.5f));
  return _mm256_fmadd_ps(half_x, erf8(_mm256_mul_ps(x, set1(0.70710678118654752f))), half_x);
}

// 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
MLXD_AVX2 inline __m256 gelu_tanh8(__m256 x) {
  __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  __m256 two_u = _mm256_mul_ps(set1(1.59576912160573071f), _mm256_fmadd_ps(set1(0.044715f), x3, x));
  return _mm256_mul_ps(x, sigmoid8(two_u));
}

// relu6(x + 3) / 6 and x * relu6(x + 3) / 6 in torch's order of operations (a division, not
// a multiply by 1/6), so float32 results match eager's bit for bit; NaN stays NaN (max / min
// return their second operand when one is NaN).
MLXD_AVX2 inline __m256 relu6_shift8(__m256 x) {
  return _mm256_min_ps(set1(6.f), _mm256_max_ps(_mm256_setzero_ps(), _mm256_add_ps(x, set1(3.f))));
}
MLXD_AVX2 inline __m256 hardsigmoid8(__m256 x) { return _mm256_div_ps(relu6_shift8(x), set1(6.f)); }
MLXD_AVX2 inline __m256 hardswish8(__m256 x) { return _mm256_div_ps(_mm256_mul_ps(x, relu6_shift8(x)), set1(6.f)); }

MLXD_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#define MLXD_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

// Eight floats from p, for dot2.
struct LoadF32 {
  MLXD_AVX2_F16C static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
};

// x . w over k elements: two accumulator chains of eight lanes, so consecutive FMAs do not wait on each
// other. L::load8(p) gives eight of w's elements as floats (16-bit types widen); the tail one by one.
template <typename L, typename T>
MLXD_AVX2_F16C inline float dot2(const float* x, const T* w, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    a0 = _mm256_fmadd_ps(L::load8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(L::load8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  if (i + 8 <= k) {
    a0 = _mm256_fmadd_ps(L::load8(w + i), _mm256_loadu_ps(x + i), a0);
    i += 8;
  }
  float total = hsum8(_mm256_add_ps(a0, a1));
  for (; i < k; ++i) total += static_cast<float>(w[i]) * x[i];
  return total;
}

// dot2 for NB weight rows against the same x, each summed in dot2's order (so outputs equal dot2's);
// with NB > 1 each row's next one (`next` elements on) is prefetched at the same columns, the rows being
// separate streams (cpu_stream_rows).
template <typename L, typename T, int NB>
MLXD_AVX2_F16C inline void dot2_rows(const float* x, const T* const (&w)[NB], int64_t k, int64_t next,
                                     float (&out)[NB]) {
  __m256 a0[NB], a1[NB];
  for (int j = 0; j < NB; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int j = 0; j < NB; ++j) {
      if constexpr (NB > 1)
        if ((i * sizeof(T)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w[j] + next + i), _MM_HINT_T0);
      a0[j] = _mm256_fmadd_ps(L::load8(w[j] + i), x0, a0[j]);
      a1[j] = _mm256_fmadd_ps(L::load8(w[j] + i + 8), x1, a1[j]);
    }
  }
  const bool eight = i + 8 <= k;
  for (int j = 0; j < NB; ++j) {
    int64_t e = i;
    if (eight) {
      a0[j] = _mm256_fmadd_ps(L::load8(w[j] + e), _mm256_loadu_ps(x + e), a0[j]);
      e += 8;
    }
    out[j] = hsum8(_mm256_add_ps(a0[j], a1[j]));
    for (; e < k; ++e) out[j] += static_cast<float>(w[j][e]) * x[e];
  }
}

MLXD_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The first n (< 8) lanes of p, the rest `fill`: row tails without reading past the end.
MLXD_AVX2 inline __m256 load_partial(const float* p, int n, float fill) {
  alignas(32) float buf[8];
  for (int i = 0; i < 8; ++i) buf[i] = i < n ? p[i] : fill;
  return _mm256_load_ps(buf);
}

MLXD_AVX2 inline void store_partial(float* p, __m256 v, int n) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  for (int i = 0; i < n; ++i) p[i] = buf[i];
}

// ---- AVX-512F: sixteen lanes, for the kernels that check cpu_use_avx512() ----
#define MLXD_AVX512 __attribute__((target("avx512f,avx2,fma")))

// exp8's reduction and polynomial on sixteen lanes; 2^n by scalef. Same
// results at the edges: inf above the range, 0 below FLT_MIN, NaN kept
// (max/min return their second operand when one is NaN).
// The reduction and polynomial alone, for x already inside the range the caller
// needs (no clamp, no edge blends).
MLXD_AVX512 inline __m512 exp16_core(__m512 xc) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

MLXD_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7228394f), lo = _mm512_set1_ps(-87.3365448f);
  __m512 y = exp16_core(_mm512_min_ps(hi, _mm512_max_ps(lo, x)));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y, _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
}

MLXD_AVX512 inline __m512 set16(float v) { return _mm512_set1_ps(v); }

MLXD_AVX512 inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(set16(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

MLXD_AVX512 inline __m512 sigmoid16(__m512 x) {
  return _mm512_div_ps(set16(1.f), _mm512_add_ps(set16(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// erf8's rational approximation on sixteen lanes.
MLXD_AVX512 inline __m512 erf16(__m512 x) {
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x, set16(-4.f)), set16(4.f));
  __m512 x2 = _mm512_mul_ps(xc, xc);
  __m512 p = set16(kErfP[0]), q = set16(kErfQ[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, x2, set16(kErfP[i]));
  for (int i = 1; i < 5; ++i) q = _mm512_fmadd_ps(q, x2, set16(kErfQ[i]));
  __m512 y = _mm512_div_ps(_mm512_mul_ps(xc, p), q);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}

MLXD_AVX512 inline __m512 gelu_erf16(__m512 x) {
  __m512 half_x = _mm512_mul_ps(x, set16(0.5f));
  return _mm512_fmadd_ps(half_x, erf16(_mm512_mul_ps(x, set16(0.70710678118654752f))), half_x);
}

MLXD_AVX512 inline __m512 gelu_tanh16(__m512 x) {
  __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  __m512 two_u = _mm512_mul_ps(set16(1.59576912160573071f), _mm512_fmadd_ps(set16(0.044715f), x3, x));
  return _mm512_mul_ps(x, sigmoid16(two_u));
}

MLXD_AVX512 inline __m512 relu6_shift16(__m512 x) {
  return _mm512_min_ps(set16(6.f), _mm512_max_ps(_mm512_setzero_ps(), _mm512_add_ps(x, set16(3.f))));
}
MLXD_AVX512 inline __m512 hardsigmoid16(__m512 x) { return _mm512_div_ps(relu6_shift16(x), set16(6.f)); }
MLXD_AVX512 inline __m512 hardswish16(__m512 x) {
  return _mm512_div_ps(_mm512_mul_ps(x, relu6_shift16(x)), set16(6.f));
}

// The mask of the first n (<= 16) lanes.
MLXD_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1u);
}

// y[i] = clamp(y[i] + bias + residual[i]) (residual may be null), i < n: a product's epilogue, after the
// product was written with beta 0. max(lo, v) keeps a NaN, as the scalar loops do.
MLXD_AVX2 inline void add_bias_residual_clamp(float* y, int64_t n, float bias, const float* residual, float lo,
                                              float hi) {
  const __m256 b = _mm256_set1_ps(bias), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_add_ps(_mm256_loadu_ps(y + i), b);
    if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i));
    _mm256_storeu_ps(y + i, _mm256_min_ps(h, _mm256_max_ps(l, v)));
  }
  for (; i < n; ++i) {
    y[i] = std::min(std::max(y[i] + bias + (residual ? residual[i] : 0.f), lo), hi);
  }
}

}  // namespace mlxd::rt::vmath
#endif
