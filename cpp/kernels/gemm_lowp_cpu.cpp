// bfloat16 / float16 matmul and the float32 GEMV on the CPU; see gemm_lowp_cpu.h.
//
// The GEMV computes y[m, n] = dot(x[m, :], w[n, :]) with w = b^T stored
// [N, K] row-major: a linear's weight as it is, so both operands stream along
// K and one load of w serves every row of x. Outputs (N) are split across the
// cores; rows are taken kGemmLowpGemvRows at a time.
#include "kernels/gemm_lowp_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MLXD_GEMM_LOWP_X86 1
#endif

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

constexpr int kRows = static_cast<int>(kGemmLowpGemvRows);

// ---- MKL's bf16/fp16 gemm, offered by libmlxd_blas.so when it is loaded ------

// Row-major c = op(a) . op(b) in fp32; dtype 0 bfloat16, 1 float16; returns 0 if not served.
using BlasGemmFn = int (*)(int dtype, int trans_a, int trans_b, int m, int n, int k, const uint16_t* a, int lda,
                           const uint16_t* b, int ldb, float* c, int ldc);

struct Blas {
  BlasGemmFn gemm = nullptr;
  std::array<bool, 2> ready{};  // by dtype code
};

const Blas& blas() {
  static const Blas b = [] {
    Blas r;
    auto ready = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "mlxd_gemm_lowp_ready"));
    r.gemm = reinterpret_cast<BlasGemmFn>(dlsym(RTLD_DEFAULT, "mlxd_gemm_lowp"));
    for (int code = 0; code < 2 && ready && r.gemm; ++code) r.ready[code] = ready(code) == 1;
    return r;
  }();
  return b;
}

// 0 bfloat16, 1 float16 (the shim's codes), 2 float32 (GEMV only).
int dtype_code(mx::Dtype t) { return t == mx::bfloat16 ? 0 : t == mx::float16 ? 1 : 2; }

// ---- Operand layouts -----------------------------------------------------------

// A logical rows x cols matrix of elements E (uint16_t for bf16/fp16 bits,
// float): element (r, c) is at p[r * ld + c], or at p[c * ld + r] when `trans`
// (stored transposed).
template <typename E>
struct Mat {
  const E* p;
  int64_t ld;
  bool trans;
};

// The matrix at p with element strides (sr, sc), if it is row-major or
// transposed with a usable leading dimension (strides of unit dims do not matter).
template <typename E>
std::optional<Mat<E>> as_mat(const E* p, int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  if ((cols == 1 || sc == 1) && (rows == 1 || sr >= cols)) return Mat<E>{p, rows == 1 ? cols : sr, false};
  if ((rows == 1 || sr == 1) && (cols == 1 || sc >= rows)) return Mat<E>{p, cols == 1 ? rows : sc, true};
  return std::nullopt;
}

// Copies the strided matrix into `buf`, row-major or transposed as asked.
template <typename E>
Mat<E> pack(const E* p, int64_t rows, int64_t cols, int64_t sr, int64_t sc, bool trans, std::vector<E>& buf) {
  buf.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) buf[trans ? c * rows + r : r * cols + c] = p[r * sr + c * sc];
  return Mat<E>{buf.data(), trans ? rows : cols, trans};
}

// The matrix in the layout asked, packing only when it is not already in it.
template <typename E>
Mat<E> in_layout(const E* p, int64_t rows, int64_t cols, int64_t sr, int64_t sc, bool trans, std::vector<E>& buf) {
  auto m = as_mat(p, rows, cols, sr, sc);
  return m && m->trans == trans ? *m : pack(p, rows, cols, sr, sc, trans, buf);
}

// ---- GEMV kernels ----------------------------------------------------------------

struct Gemv {
  const void* x;    // [M, K] row-major with leading dimension ldx, operand dtype
  int64_t ldx;
  const float* xf;  // the same rows in fp32, dense [M, K] (read by the converting kernels)
  const void* w;    // [N, K] row-major with leading dimension ldw (b transposed), operand dtype
  int64_t ldw;
  void* y;          // [M, N] result with leading dimension ldy, operand dtype
  int64_t ldy;
  int64_t k;
};

// Row n of w as elements T.
template <typename T>
const T* w_row(const Gemv& g, int64_t n) {
  return static_cast<const T*>(g.w) + n * g.ldw;
}
using GemvFn = void (*)(const Gemv&, int64_t n0, int64_t n1);

template <typename T, int M>
void store(const Gemv& g, int64_t n, const float* acc) {
  T* y = static_cast<T*>(g.y);
  for (int m = 0; m < M; ++m) y[m * g.ldy + n] = static_cast<T>(acc[m]);
}

template <typename T, int M>
void gemv_portable(const Gemv& g, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* wn = w_row<T>(g, n);
    float acc[M] = {};
    for (int64_t k = 0; k < g.k; ++k) {
      const float v = static_cast<float>(wn[k]);
      for (int m = 0; m < M; ++m) acc[m] += v * g.xf[m * g.k + k];
    }
    store<T, M>(g, n, acc);
  }
}

#ifdef MLXD_GEMM_LOWP_X86
#define MLXD_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define MLXD_AVX512F __attribute__((target("avx512f,avx2,fma")))

// Eight weights as floats: bf16 is the top half of an fp32, so widen and shift.
template <typename T>
MLXD_AVX2_F16C inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, mx::bfloat16_t>)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else
    return _mm256_cvtph_ps(h);
}

// vmath::dot2's loader for w's elements.
template <typename T>
struct Widen {
  MLXD_AVX2_F16C static __m256 load8(const T* p) { return mlxd::rt::load8(p); }
};

template <typename T, int M>
MLXD_AVX2_F16C void gemv_avx2(const Gemv& g, int64_t n0, int64_t n1) {
  // One row: cpu_weight_streams() weight rows at a time, each its own stream (see gemv_avx512f), two FMA
  // chains a row (a SmolLM2 bf16 decode step on these kernels 14.6 -> 13.4 ms against one, paired).
  if constexpr (M == 1) {
    auto rows = [&](int64_t n, int64_t stride, auto nb) {
      constexpr int NB = decltype(nb)::value;
      const T* w[NB];
      for (int j = 0; j < NB; ++j) w[j] = w_row<T>(g, n + j * stride);
      float total[NB];
      vmath::dot2_rows<Widen<T>>(g.xf, w, g.k, g.ldw, total);
      for (int j = 0; j < NB; ++j) store<T, 1>(g, n + j * stride, &total[j]);
    };
    const int streams = cpu_weight_streams();
    if (streams >= 4) cpu_stream_rows<4>(n0, n1, rows);
    else if (streams == 2) cpu_stream_rows<2>(n0, n1, rows);
    else cpu_stream_rows<1>(n0, n1, rows);
    return;
  }
  const int64_t k8 = g.k - g.k % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const T* wn = w_row<T>(g, n);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
      const __m256 v = load8(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(g.xf + m * g.k + k), acc[m]);
    }
    float total[M];
    for (int m = 0; m < M; ++m) {
      total[m] = vmath::hsum8(acc[m]);
      for (int64_t k = k8; k < g.k; ++k) total[m] += static_cast<float>(wn[k]) * g.xf[m * g.k + k];
    }
    store<T, M>(g, n, total);
  }
}

// bf16 pairs multiplied and summed into fp32 lanes by vdpbf16ps, 32 weights per
// instruction. NB outputs at a time: each load of a row of x serves NB weight
// rows and the NB * M accumulators are independent chains (hiding the
// instruction's latency). The K tail is a masked load.
MLXD_AVX512BF16 inline __m512 dot32(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

template <bool Masked>
MLXD_AVX512BF16 inline __m512i load32(const uint16_t* p, __mmask32 mask) {
  if constexpr (Masked) return _mm512_maskz_loadu_epi16(mask, p);
  else return _mm512_loadu_si512(p);
}

// acc[j][m] += x[m, k:k+32] . w[n + j, k:k+32]
template <int M, int NB, bool Masked>
MLXD_AVX512BF16 inline void dot_step(const Gemv& g, int64_t n, int64_t k, __mmask32 mask, __m512 (&acc)[NB][M]) {
  __m512i w[NB];
  for (int j = 0; j < NB; ++j) w[j] = load32<Masked>(w_row<uint16_t>(g, n + j) + k, mask);
  for (int m = 0; m < M; ++m) {
    const __m512i x = load32<Masked>(static_cast<const uint16_t*>(g.x) + m * g.ldx + k, mask);
    for (int j = 0; j < NB; ++j) acc[j][m] = dot32(acc[j][m], x, w[j]);
  }
}

template <int M, int NB>
MLXD_AVX512BF16 inline void dot_rows_avx512bf16(const Gemv& g, int64_t n, int64_t k32, __mmask32 tail) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k32; k += 32) dot_step<M, NB, false>(g, n, k, tail, acc);
  if (k32 < g.k) dot_step<M, NB, true>(g, n, k32, tail, acc);
  for (int j = 0; j < NB; ++j) {
    float total[M];
    for (int m = 0; m < M; ++m) total[m] = _mm512_reduce_add_ps(acc[j][m]);
    store<mx::bfloat16_t, M>(g, n + j, total);
  }
}

// One output for one row of x (bf16 elements), two accumulator chains; see gemv_avx512f.
MLXD_AVX512BF16 inline float dot_stream_bf16(const uint16_t* x, const uint16_t* w, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    a0 = dot32(a0, load32<false>(x + i, 0), load32<false>(w + i, 0));
    a1 = dot32(a1, load32<false>(x + i + 32, 0), load32<false>(w + i + 32, 0));
  }
  for (; i < k; i += 32) {
    const __mmask32 m = k - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (k - i)) - 1);
    a0 = dot32(a0, load32<true>(x + i, m), load32<true>(w + i, m));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

template <int M>
MLXD_AVX512BF16 void gemv_avx512bf16(const Gemv& g, int64_t n0, int64_t n1) {
  if constexpr (M == 1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float total[1] = {dot_stream_bf16(static_cast<const uint16_t*>(g.x), w_row<uint16_t>(g, n), g.k)};
      store<mx::bfloat16_t, 1>(g, n, total);
    }
    return;
  }
  constexpr int NB = M <= 4 ? 4 : 2;  // at most 16 accumulators
  const int64_t k32 = g.k - g.k % 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (g.k - k32)) - 1);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_rows_avx512bf16<M, NB>(g, n, k32, tail);
  for (; n < n1; ++n) dot_rows_avx512bf16<M, 1>(g, n, k32, tail);
}

// float32 with AVX-512F: the same shape, 16 lanes, one FMA per (output, row)
// and step; NB outputs at a time give NB * M independent accumulator chains
// (4 for one row) so the FMA latency hides behind the weight stream.
template <bool Masked>
MLXD_AVX512F inline __m512 load16(const float* p, __mmask16 mask) {
  if constexpr (Masked) return _mm512_maskz_loadu_ps(mask, p);
  else return _mm512_loadu_ps(p);
}

template <int M, int NB, bool Masked>
MLXD_AVX512F inline void fma_step(const Gemv& g, int64_t n, int64_t k, __mmask16 mask, __m512 (&acc)[NB][M]) {
  __m512 w[NB];
  for (int j = 0; j < NB; ++j) w[j] = load16<Masked>(w_row<float>(g, n + j) + k, mask);
  for (int m = 0; m < M; ++m) {
    const __m512 x = load16<Masked>(g.xf + m * g.k + k, mask);
    for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_fmadd_ps(x, w[j], acc[j][m]);
  }
}

template <int M, int NB>
MLXD_AVX512F inline void dot_rows_avx512f(const Gemv& g, int64_t n, int64_t k16, __mmask16 tail) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k16; k += 16) fma_step<M, NB, false>(g, n, k, tail, acc);
  if (k16 < g.k) fma_step<M, NB, true>(g, n, k16, tail, acc);
  for (int j = 0; j < NB; ++j) {
    float total[M];
    for (int m = 0; m < M; ++m) total[m] = _mm512_reduce_add_ps(acc[j][m]);
    store<float, M>(g, n + j, total);
  }
}

// Outputs n0 + j * stride (j < NB) for one row of x, each weight row its own stream (cpu_stream_rows),
// prefetched a row ahead where there are several; two accumulator chains over K a row, summed in the same
// order whatever NB.
template <int NB>
MLXD_AVX512F void dot_streams_f32(const Gemv& g, int64_t n0, int64_t stride) {
  const float* w[NB];
  __m512 a0[NB], a1[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = w_row<float>(g, n0 + j * stride);
    a0[j] = a1[j] = _mm512_setzero_ps();
  }
  const float* x = g.xf;
  const int64_t k = g.k;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
    for (int j = 0; j < NB; ++j) {
      if constexpr (NB > 1) {
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + g.ldw + i), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + g.ldw + i + 16), _MM_HINT_T0);
      }
      a0[j] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w[j] + i), a0[j]);
      a1[j] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(w[j] + i + 16), a1[j]);
    }
  }
  for (; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 xm = _mm512_maskz_loadu_ps(m, x + i);
    for (int j = 0; j < NB; ++j) a0[j] = _mm512_fmadd_ps(xm, _mm512_maskz_loadu_ps(m, w[j] + i), a0[j]);
  }
  for (int j = 0; j < NB; ++j) {
    const float total[1] = {_mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]))};
    store<float, 1>(g, n0 + j * stride, total);
  }
}

// One row of x (a decode step's products) reads cpu_weight_streams() weight rows at a time, each its
// own sequential stream. One on Zen 4, whose prefetchers follow a single stream best: eight adjacent rows
// (as many short streams in a SmolLM2 row of 2.3 KB) streamed 17 GB/s a thread there against 27 one row
// at a time, and a SmolLM2 fp32 decode step went from 0.76-0.81x to 0.98-1.04x ExecuTorch's XNNPACK Llama
// export. Four far apart on the Ice Lake Xeon: two threads streamed 27-29 GB/s against 21-23 one row at a
// time (the 1.2B's and SmolLM2's shapes, at or above MKL's sgemm). Several rows of x share each weight
// load instead.
template <int M>
MLXD_AVX512F void gemv_avx512f(const Gemv& g, int64_t n0, int64_t n1) {
  if constexpr (M == 1) {
    auto rows = [&](int64_t n, int64_t stride, auto nb) { dot_streams_f32<decltype(nb)::value>(g, n, stride); };
    const int streams = cpu_weight_streams();
    if (streams >= 4) cpu_stream_rows<4>(n0, n1, rows);
    else if (streams == 2) cpu_stream_rows<2>(n0, n1, rows);
    else cpu_stream_rows<1>(n0, n1, rows);
    return;
  }
  constexpr int NB = M <= 4 ? 4 : 2;  // at most 16 accumulators
  const int64_t k16 = g.k - g.k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (g.k - k16)) - 1);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_rows_avx512f<M, NB>(g, n, k16, tail);
  for (; n < n1; ++n) dot_rows_avx512f<M, 1>(g, n, k16, tail);
}
#endif

// ---- Kernel choice -----------------------------------------------------------------

enum class Isa { portable, avx2, avx512f, avx512bf16 };  // each includes the ones before

// MLX_DELEGATE_CPU_KERNELS=portable: the portable loop; =avx2: at most AVX2
// (to test that code on CPUs with more); otherwise the best the CPU has.
Isa cpu_isa() {
  static const Isa isa = [] {
    if (cpu_kernel_mode() != CpuKernelMode::best) return Isa::portable;
#ifdef MLXD_GEMM_LOWP_X86
    __builtin_cpu_init();
    const char* v = std::getenv("MLX_DELEGATE_CPU_KERNELS");
    const bool cap_avx2 = v && std::strcmp(v, "avx2") == 0;
    if (!cap_avx2 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"))
      return Isa::avx512bf16;
    if (!cap_avx2 && __builtin_cpu_supports("avx512f")) return Isa::avx512f;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::avx2;
#endif
    return Isa::portable;
  }();
  return isa;
}

template <typename T, int... Ms>
std::array<GemvFn, sizeof...(Ms)> gemv_table(Isa isa, std::integer_sequence<int, Ms...>) {
#ifdef MLXD_GEMM_LOWP_X86
  if constexpr (std::is_same_v<T, mx::bfloat16_t>)
    if (isa == Isa::avx512bf16) return {gemv_avx512bf16<Ms + 1>...};
  if constexpr (std::is_same_v<T, float>)
    if (isa >= Isa::avx512f) return {gemv_avx512f<Ms + 1>...};
  if (isa != Isa::portable) return {gemv_avx2<T, Ms + 1>...};
#endif
  return {gemv_portable<T, Ms + 1>...};
}

// The kernel for `rows` (1..kRows) rows of dtype code 0 (bf16), 1 (fp16) or 2 (fp32).
GemvFn pick_gemv(int code, int64_t rows) {
  static const std::array<std::array<GemvFn, kRows>, 3> table = [] {
    auto ms = std::make_integer_sequence<int, kRows>{};
    return std::array{gemv_table<mx::bfloat16_t>(cpu_isa(), ms), gemv_table<mx::float16_t>(cpu_isa(), ms),
                      gemv_table<float>(cpu_isa(), ms)};
  }();
  return table[code][rows - 1];
}

// ---- One product ---------------------------------------------------------------------

// One operand of the batched product: [batch, rows, cols] with element strides.
struct Operand {
  const void* p;
  int64_t batch_stride, sr, sc;
};

struct Product {
  Operand a, b;  // a [B, M, K], b [B, K, N]
  void* out;  // [B, M, N] row-contiguous
  int64_t batch, m, n, k;
  int code;  // dtype_code: 0 bfloat16, 1 float16, 2 float32
};

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// MKL for products of more rows than the GEMV takes, when the shim offers it.
bool use_blas(const Product& p) {
  return p.m > kGemmLowpGemvRows && p.code < 2 && blas().ready[p.code] && fits_int(p.m) && fits_int(p.n) && fits_int(p.k);
}

template <typename T, typename E>
void to_f32(const Mat<E>& x, int64_t rows, int64_t k, std::vector<float>& xf) {
  xf.resize(static_cast<size_t>(rows * k));
  const T* src = reinterpret_cast<const T*>(x.p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) xf[r * k + i] = static_cast<float>(src[r * x.ld + i]);
}

// The rows of x as dense fp32 [M, K]: converted for 16-bit operands, float32
// ones read in place when already dense.
template <typename E>
const float* dense_f32(const Product& p, const Mat<E>& x, std::vector<float>& xf) {
  if constexpr (std::is_same_v<E, float>) {
    if (x.ld == p.k) return x.p;
    to_f32<float>(x, p.m, p.k, xf);
  } else if (p.code == 0) {
    to_f32<mx::bfloat16_t>(x, p.m, p.k, xf);
  } else {
    to_f32<mx::float16_t>(x, p.m, p.k, xf);
  }
  return xf.data();
}

template <typename E>
void gemv_one(const Product& p, const Mat<E>& x, const Mat<E>& w, E* out) {
  std::vector<float> buf;
  const float* xf = dense_f32(p, x, buf);
  cpu_parallel_for(p.n, p.k * std::min(p.m, kGemmLowpGemvRows), 1, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < p.m; r += kGemmLowpGemvRows) {
      const int64_t rows = std::min(kGemmLowpGemvRows, p.m - r);
      Gemv g{x.p + r * x.ld, x.ld, xf + r * p.k, w.p, w.ld, out + r * p.n, p.n, p.k};
      pick_gemv(p.code, rows)(g, n0, n1);
    }
  });
}

bool blas_one(const Product& p, const Mat<uint16_t>& a, const Mat<uint16_t>& b, uint16_t* out) {
  if (!fits_int(a.ld) || !fits_int(b.ld)) return false;
  std::vector<float> c(static_cast<size_t>(p.m * p.n));
  if (!blas().gemm(p.code, a.trans, b.trans, static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), a.p,
                   static_cast<int>(a.ld), b.p, static_cast<int>(b.ld), c.data(), static_cast<int>(p.n)))
    return false;
  cpu_store_f32(c.data(), p.code == 0 ? mx::bfloat16 : mx::float16, 0, p.m * p.n, out);
  return true;
}

// E: the element type (uint16_t for the 16-bit dtypes, float).
template <typename E>
void run_product(const Product& p, bool blas_path) {
  std::vector<E> abuf, bbuf;
  for (int64_t i = 0; i < p.batch; ++i) {
    const E* ap = static_cast<const E*>(p.a.p) + i * p.a.batch_stride;
    const E* bp = static_cast<const E*>(p.b.p) + i * p.b.batch_stride;
    E* out = static_cast<E*>(p.out) + i * p.m * p.n;
    if constexpr (std::is_same_v<E, uint16_t>) {
      if (blas_path) {
        auto a = as_mat(ap, p.m, p.k, p.a.sr, p.a.sc);
        auto b = as_mat(bp, p.k, p.n, p.b.sr, p.b.sc);
        if (blas_one(p, a ? *a : pack(ap, p.m, p.k, p.a.sr, p.a.sc, false, abuf),
                     b ? *b : pack(bp, p.k, p.n, p.b.sr, p.b.sc, false, bbuf), out))
          continue;
      }
    }
    // The GEMV reads x = a row-major and w = b transposed ([N, K] row-major).
    gemv_one(p, in_layout(ap, p.m, p.k, p.a.sr, p.a.sc, false, abuf),
             in_layout(bp, p.k, p.n, p.b.sr, p.b.sc, true, bbuf), out);
  }
}

// ---- The MLX primitive ------------------------------------------------------------------

// A [B, M, K] / [B, K, N] operand; a 2-D one is shared by every batch, and a
// weight given as [N, K] (`nk`) is read as its transpose.
Operand operand(const mx::array& x, bool nk = false) {
  if (nk) return {x.data<void>(), 0, x.strides(1), x.strides(0)};
  if (x.ndim() == 2) return {x.data<void>(), 0, x.strides(0), x.strides(1)};
  return {x.data<void>(), x.shape(0) > 1 ? x.strides(0) : 0, x.strides(1), x.strides(2)};
}

const ChainableKernel kGemmLowpCpuChainable{"GemmLowpCpu"};  // kernel_chain.h

class GemmLowpCpu : public mx::UnaryPrimitive {
 public:
  GemmLowpCpu(mx::Stream s, bool weight_nk) : mx::UnaryPrimitive(s), weight_nk_(weight_nk) {}

  // inputs: a [B, M, K]; b [B, K, N], [K, N] or (weight_nk) a linear's [N, K]
  // weight, any strides; same dtype (bfloat16 or float16; float32 with M <= kRows).
  // Operands go in as they are: a reshape or transpose node per call costs
  // more dispatch than a decode GEMV's arithmetic.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto &a = in[0], &b = in[1];
    Product p{operand(a), operand(b, weight_nk_), out.data<void>(), out.shape(0), out.shape(1), out.shape(2), a.shape(2),
              dtype_code(out.dtype())};
    const bool blas_path = use_blas(p);
    if (p.code == 2) {
      cpu_kernel_note_call("gemv_f32");
      encoder.dispatch([p] { run_product<float>(p, false); });
    } else {
      cpu_kernel_note_call(blas_path ? "gemm_lowp_blas" : "gemm_lowp_gemv");
      encoder.dispatch([p, blas_path] { run_product<uint16_t>(p, blas_path); });
    }
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("GemmLowpCpu runs on the CPU only");
  }
  const char* name() const override { return "GemmLowpCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return weight_nk_ == static_cast<const GemmLowpCpu&>(other).weight_nk_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), in[0].shape(1), weight_nk_ ? in[1].shape(0) : in[1].shape(-1)}};
  }

 private:
  bool weight_nk_;
};

mx::array with_shape(const mx::array& x, const mx::Shape& shape) {
  return x.shape() == shape ? x : mx::reshape(x, shape);
}

// a @ b, or a @ b^T for a [N, K] weight (weight_nk); see GemmLowpCpu.
mx::array make_product(const mx::array& a, const mx::array& b, bool weight_nk) {
  const int k = a.shape(-1), n = weight_nk ? b.shape(0) : b.shape(-1);
  // A 2-D b multiplies every row of a: fold a's batch axes into its rows.
  const bool fold = b.ndim() == 2;
  const int m = fold ? static_cast<int>(a.size() / k) : a.shape(-2);
  const int batch = fold ? 1 : static_cast<int>(a.size() / (int64_t{m} * k));
  auto a3 = with_shape(a, {batch, m, k});
  auto b_in = fold ? b : with_shape(b, {batch, k, n});
  auto y = mx::array({batch, m, n}, a.dtype(),
                     std::make_shared<GemmLowpCpu>(mx::default_stream(mx::Device::cpu), weight_nk), {a3, b_in});
  auto shape = a.shape();
  shape.back() = n;
  return with_shape(y, shape);
}

// Whether the batch shapes of a and b (all but the last two axes) are equal.
bool same_batch(const mx::array& a, const mx::array& b) {
  if (a.ndim() != b.ndim()) return false;
  for (int i = 0; i + 2 < static_cast<int>(a.ndim()); ++i)
    if (a.shape(i) != b.shape(i)) return false;
  return true;
}

// Whether the 2-D b ([K, N]) is stored transposed, so the GEMV reads it as
// [N, K] in place: evaluated with such strides, or (not yet evaluated) the
// transpose view of an evaluated row-major matrix, as a linear's weight is.
bool transposed_in_place(const mx::array& b) {
  if (b.ndim() != 2) return false;
  if (b.is_available()) {
    const auto m = as_mat(static_cast<const float*>(nullptr), b.shape(0), b.shape(1), b.strides(0), b.strides(1));
    return m && m->trans;
  }
  if (!b.has_primitive() || std::strcmp(b.primitive().name(), "Transpose") != 0) return false;
  const auto& src = b.inputs()[0];
  return src.ndim() == 2 && src.is_available() && src.flags().row_contiguous;
}

// float32: only the GEMV (rows of a, batch axes folded, at most kRows) with the
// weight read in place; more rows, or a b that would have to be copied, stay
// on MLX's matmul (MKL's sgemm).
bool gemv_f32_applies(const mx::array& a, const mx::array& b) {
  return b.ndim() == 2 && static_cast<int64_t>(a.size() / a.shape(-1)) <= kGemmLowpGemvRows &&
         transposed_in_place(b);
}

}  // namespace

bool gemm_lowp_cpu_applies(const mx::array& a, const mx::array& b) {
  if (!cpu_kernels_active() || a.dtype() != b.dtype()) return false;
  if (a.dtype() != mx::bfloat16 && a.dtype() != mx::float16 && a.dtype() != mx::float32) return false;
  if (a.ndim() < 2 || b.ndim() < 2 || a.size() == 0 || b.size() == 0 || a.shape(-1) != b.shape(-2)) return false;
  if (a.dtype() == mx::float32) return gemv_f32_applies(a, b);
  return b.ndim() == 2 || same_batch(a, b);
}

mx::array gemm_lowp_cpu(const mx::array& a, const mx::array& b) {
  if (!gemm_lowp_cpu_applies(a, b)) throw std::invalid_argument("gemm_lowp_cpu: operands it does not take");
  return make_product(a, b, false);
}

bool gemm_lowp_cpu_linear_applies(const mx::array& x, const mx::array& w) {
  if (w.ndim() != 2 || x.ndim() < 2) return false;
  // The fp32 GEMV reads the weight in place only when it is an evaluated row-major matrix.
  if (x.dtype() == mx::float32 && !(w.is_available() && w.flags().row_contiguous)) return false;
  return gemm_lowp_cpu_applies(x, mx::transpose(w));  // a view, never evaluated
}

mx::array gemm_lowp_cpu_linear(const mx::array& x, const mx::array& w) {
  if (!gemm_lowp_cpu_linear_applies(x, w)) throw std::invalid_argument("gemm_lowp_cpu_linear: operands it does not take");
  return make_product(x, w, true);
}

}  // namespace mlxd::rt
