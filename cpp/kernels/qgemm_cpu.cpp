// Prefill-sized quantized products: dequantize a chunk of w's rows to float32,
// then one serial sgemm of all rows of x against it (see qgemm_cpu.h).
#include "kernels/qgemm_cpu.h"

#include "kernels/cpu_parallel.h"
#include "kernels/qgemv_cpu.h"
#include "kernels/vec_math_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

struct Problem {
  const float* x;       // [M, K] row-major
  const uint32_t* w;    // [N, K * bits / 32]
  const float* scales;  // [N, G]
  const float* biases;  // [N, G]
  float* y;             // [M, N]
  int64_t m, n, k, groups, group_size, words_per_row;
};

// ---- One row of w to float32: scale * q + bias per group ----------------------

template <int Bits>
void dequantize_row_portable(const Problem& p, int64_t row, float* out) {
  constexpr int per_word = 32 / Bits;
  constexpr uint32_t mask = (1u << Bits) - 1;
  const uint32_t* wn = p.w + row * p.words_per_row;
  for (int64_t g = 0; g < p.groups; ++g) {
    const float s = p.scales[row * p.groups + g], b = p.biases[row * p.groups + g];
    for (int64_t e = g * p.group_size; e < (g + 1) * p.group_size; e += per_word) {
      const uint32_t word = wn[e / per_word];
      for (int i = 0; i < per_word; ++i) out[e + i] = s * static_cast<float>((word >> (Bits * i)) & mask) + b;
    }
  }
}

#ifdef MLXD_CPU_X86
// Eight weights per step: one word shifted per lane (int4) or eight bytes
// widened (int8), converted and scaled with one FMA.
template <int Bits>
MLXD_AVX2 void dequantize_row_avx2(const Problem& p, int64_t row, float* out) {
  const uint32_t* wn = p.w + row * p.words_per_row;
  const auto* bytes = reinterpret_cast<const uint8_t*>(wn);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low4 = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < p.groups; ++g) {
    const __m256 s = _mm256_set1_ps(p.scales[row * p.groups + g]), b = _mm256_set1_ps(p.biases[row * p.groups + g]);
    for (int64_t e = g * p.group_size; e < (g + 1) * p.group_size; e += 8) {
      __m256i q;
      if constexpr (Bits == 4)
        q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(wn[e / 8])), shifts), low4);
      else
        q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + e)));
      _mm256_storeu_ps(out + e, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b));
    }
  }
}
#endif

// ---- Panels of the own tile: w's rows as lanes ----------------------------------

// Columns [j, j + nr) of op(w) = w^T over k in [pc, pc + kc), i.e. w's rows n0 + j ..., as one
// width-wide panel: dst[e * width + r] = w[n0 + j + r][pc + e], zeros for r >= nr (sgemm_x86.h, BPanelFn).
struct PanelSource {
  const Problem* p;
  int64_t n0;  // the part's first row of w
};

template <int Bits>
void dequantize_panel_portable(void* ctx, int j, int nr, int pc, int kc, float* dst, int width) {
  const auto& c = *static_cast<const PanelSource*>(ctx);
  const Problem& p = *c.p;
  constexpr int per_word = 32 / Bits;
  constexpr uint32_t mask = (1u << Bits) - 1;
  for (int r = 0; r < width; ++r) {
    const int64_t row = c.n0 + j + r;
    for (int e = 0; e < kc; ++e) {
      const int64_t col = pc + e, g = col / p.group_size;
      if (r >= nr) {
        dst[int64_t{e} * width + r] = 0.f;
        continue;
      }
      const uint32_t word = p.w[row * p.words_per_row + col / per_word];
      const auto q = static_cast<float>((word >> (Bits * (col % per_word))) & mask);
      dst[int64_t{e} * width + r] = p.scales[row * p.groups + g] * q + p.biases[row * p.groups + g];
    }
  }
}

#ifdef MLXD_CPU_X86
// Sixteen rows a lane each, H halves of 16 (the AVX-512 tile's 32-wide panels: 2) a step: one gathered
// word per row holds per_word consecutive k, each shifted out, converted and scaled with one FMA into a
// panel row. Rows past nr gather nothing (masked) and get a zero scale and bias. The group changes at
// a counted k, not a division per step.
template <int Bits, int H>
MLXD_AVX512 void panel_avx512(const Problem& p, int64_t row0, int nr, int pc, int kc, float* dst) {
  constexpr int per_word = 32 / Bits, width = 16 * H;
  const uint32_t* panel = p.w + row0 * p.words_per_row + int64_t{pc} * Bits / 32;  // k blocks start at 8s
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mask = _mm512_set1_epi32((1 << Bits) - 1);
  const __m512i words_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(p.words_per_row)));
  const __m512i groups_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(p.groups)));
  __mmask16 valid[H];
  const int* w[H];
  const float *scales[H], *biases[H];
  for (int h = 0; h < H; ++h) {
    const int rows = std::clamp(nr - 16 * h, 0, 16), r0 = rows > 0 ? 16 * h : 0;
    valid[h] = static_cast<__mmask16>((1u << rows) - 1);
    w[h] = reinterpret_cast<const int*>(panel + r0 * p.words_per_row);
    scales[h] = p.scales + (row0 + r0) * p.groups;
    biases[h] = p.biases + (row0 + r0) * p.groups;
  }
  __m512 s[H], b[H];
  int64_t g = pc / p.group_size - 1;
  int next = 0;  // e where group g + 1 starts
  for (int e = 0; e < kc; e += per_word) {
    if (e == next) {
      ++g;
      next = static_cast<int>((g + 1) * p.group_size - pc);
      for (int h = 0; h < H; ++h) {
        s[h] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid[h], groups_at, scales[h] + g, 4);
        b[h] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid[h], groups_at, biases[h] + g, 4);
      }
    }
    __m512i words[H];
    for (int h = 0; h < H; ++h)
      words[h] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid[h], words_at, w[h] + e / per_word, 4);
#pragma GCC unroll 8
    for (int i = 0; i < per_word; ++i)
      for (int h = 0; h < H; ++h) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(words[h], Bits * i), mask);
        _mm512_storeu_ps(dst + int64_t{e + i} * width + 16 * h, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s[h], b[h]));
      }
  }
}

template <int Bits>
void dequantize_panel_avx512(void* ctx, int j, int nr, int pc, int kc, float* dst, int width) {
  const auto& c = *static_cast<const PanelSource*>(ctx);
  if (width == 32) panel_avx512<Bits, 2>(*c.p, c.n0 + j, nr, pc, kc, dst);
  else panel_avx512<Bits, 1>(*c.p, c.n0 + j, nr, pc, kc, dst);  // the AVX2 tile's 16
}

// Eight rows a step: one gathered word per row holds per_word consecutive k, each shifted out,
// converted and scaled with one FMA into a panel row. Rows past nr read row j (valid) and are zeroed by
// a zero scale and bias.
template <int Bits>
MLXD_AVX2 void dequantize_panel_avx2(void* ctx, int j, int nr, int pc, int kc, float* dst, int width) {
  const auto& c = *static_cast<const PanelSource*>(ctx);
  const Problem& p = *c.p;
  constexpr int per_word = 32 / Bits;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), mask = _mm256_set1_epi32((1 << Bits) - 1);
  const uint32_t* panel = p.w + (c.n0 + j) * p.words_per_row + int64_t{pc} * Bits / 32;
  for (int r0 = 0; r0 < width; r0 += 8) {
    const int rows = std::clamp(nr - r0, 0, 8);
    float* d = dst + r0;
    if (rows == 0) {
      for (int e = 0; e < kc; ++e) _mm256_storeu_ps(d + int64_t{e} * width, _mm256_setzero_ps());
      continue;
    }
    const int64_t row0 = c.n0 + j + r0;
    const __m256i in_rows = _mm256_min_epi32(lane, _mm256_set1_epi32(rows - 1));
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane));
    const __m256i words_at = _mm256_mullo_epi32(in_rows, _mm256_set1_epi32(static_cast<int>(p.words_per_row)));
    const __m256i groups_at = _mm256_mullo_epi32(in_rows, _mm256_set1_epi32(static_cast<int>(p.groups)));
    const auto* w = reinterpret_cast<const int*>(panel + r0 * p.words_per_row);
    const float* scales = p.scales + row0 * p.groups;
    const float* biases = p.biases + row0 * p.groups;
    __m256 s = _mm256_setzero_ps(), b = s;
    int64_t group = pc / p.group_size - 1;
    int next = 0;  // e where group + 1 starts (counted: see panel_avx512)
    for (int e = 0; e < kc; e += per_word) {
      if (e == next) {
        ++group;
        next = static_cast<int>((group + 1) * p.group_size - pc);
        s = _mm256_and_ps(_mm256_i32gather_ps(scales + group, groups_at, 4), valid);
        b = _mm256_and_ps(_mm256_i32gather_ps(biases + group, groups_at, 4), valid);
      }
      const __m256i words = _mm256_i32gather_epi32(w + e / per_word, words_at, 4);
#pragma GCC unroll 8
      for (int i = 0; i < per_word; ++i) {
        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, Bits * i), mask);
        _mm256_storeu_ps(d + int64_t{e + i} * width, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b));
      }
    }
  }
}
#endif

SgemmPanelFn pick_panel(int bits) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx512()) return bits == 4 ? dequantize_panel_avx512<4> : dequantize_panel_avx512<8>;
  if (cpu_use_avx2()) return bits == 4 ? dequantize_panel_avx2<4> : dequantize_panel_avx2<8>;
#endif
  return bits == 4 ? dequantize_panel_portable<4> : dequantize_panel_portable<8>;
}

using DequantizeFn = void (*)(const Problem&, int64_t, float*);

DequantizeFn pick_dequantize(int bits) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) return bits == 4 ? dequantize_row_avx2<4> : dequantize_row_avx2<8>;
#endif
  return bits == 4 ? dequantize_row_portable<4> : dequantize_row_portable<8>;
}

// Output rows per chunk: the chunk's float32 weights (~256 KB) stay in the
// core's cache while the sgemm reads them once per block of x's rows.
int64_t chunk_rows(int64_t k) { return std::clamp<int64_t>((int64_t{1} << 16) / k / 16 * 16, 16, 128); }

// The route: w dequantized into the own tile's panels (one product per core, x packed once per
// block), else chunks of w's rows as float32 for serial_sgemm (MKL or the own tile).
// MLX_DELEGATE_QGEMM=chunks (read per call) takes the latter for A/B runs and tests.
bool panels_route() {
  const char* e = std::getenv("MLX_DELEGATE_QGEMM");
  return serial_sgemm_b_source() != nullptr && !(e != nullptr && std::strcmp(e, "chunks") == 0);
}

void run_problem(const Problem& p, int bits) {
  if (panels_route()) {
    const SerialSgemmBSourceFn product = serial_sgemm_b_source();
    const SgemmPanelFn panel = pick_panel(bits);
    // Parts on whole panels (32 columns: the AVX-512 tile's, two of the AVX2 tile's).
    cpu_parallel_for(p.n, p.m * p.k, 32, [&](int64_t begin, int64_t end) {
      PanelSource source{&p, begin};
      product(static_cast<int>(p.m), static_cast<int>(end - begin), static_cast<int>(p.k), 1.f, p.x,
              static_cast<int>(p.k), panel, &source, 0.f, p.y + begin, static_cast<int>(p.n));
    });
    return;
  }
  const SerialSgemmFn sgemm = serial_sgemm();
  const DequantizeFn dequantize = pick_dequantize(bits);
  const int64_t rows = chunk_rows(p.k);
  cpu_parallel_for(p.n, p.m * p.k, rows, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(static_cast<size_t>(rows * p.k));
    for (int64_t n0 = begin; n0 < end; n0 += rows) {
      const int64_t nc = std::min(rows, end - n0);
      for (int64_t j = 0; j < nc; ++j) dequantize(p, n0 + j, wf.data() + j * p.k);
      sgemm(0, 1, static_cast<int>(p.m), static_cast<int>(nc), static_cast<int>(p.k), 1.f, p.x,
            static_cast<int>(p.k), wf.data(), static_cast<int>(p.k), 0.f, p.y + n0, static_cast<int>(p.n));
    }
  });
}

// ---- The MLX primitive --------------------------------------------------------

const ChainableKernel kQGemmCpuChainable{"QGemmCpu"};  // kernel_chain.h

class QGemmCpu : public QuantizedProductCpu {
 public:
  QGemmCpu(mx::Stream s, int group_size, int bits) : QuantizedProductCpu(s, "QGemmCpu", group_size, bits) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const int64_t k = in[0].shape(-1), n = in[1].shape(0);
    Problem p{nullptr, nullptr, nullptr, nullptr, out.data<float>(), static_cast<int64_t>(in[0].size()) / k, n, k,
              k / group_size_, group_size_, in[1].shape(1)};
    cpu_kernel_note_call("qgemm");
    encoder.dispatch([p, bits = bits_, in]() mutable {
      F32RowMajor x(in[0]), scales(in[2]), biases(in[3]);
      CpuRowMajor w(in[1].data<void>(), in[1].itemsize(), in[1].shape(), in[1].strides(),
                    in[1].flags().row_contiguous);
      p.x = x.data();
      p.w = static_cast<const uint32_t*>(w.data());
      p.scales = scales.data();
      p.biases = biases.data();
      run_problem(p, bits);
    });
  }
};

}  // namespace

bool qgemm_cpu_applies(const mx::array& x, int group_size, int bits) {
  // Read while a graph is built (not once at start-up), so one process can measure both routes.
  const char* off = std::getenv("MLX_DELEGATE_QGEMM");
  if (off != nullptr && std::strcmp(off, "0") == 0) return false;
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x) || serial_sgemm() == nullptr) return false;
  if (!quantized_layout_ok(x, group_size, bits)) return false;
  return static_cast<int64_t>(x.size()) / x.shape(-1) >= kQgemmMinRows;
}

mx::array qgemm_cpu(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                    int group_size, int bits) {
  check_quantized_operands("qgemm_cpu", x, w, scales, biases, group_size, bits);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<QGemmCpu>(mx::default_stream(mx::Device::cpu), group_size, bits),
                   {x, w, scales, biases});
}

}  // namespace mlxd::rt
