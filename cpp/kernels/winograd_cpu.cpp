// Winograd F(m x m, 3 x 3) convolution (see winograd_cpu.h).
//
// The output is cut into m x m tiles, TW per tile row; a group is a run of
// tile rows (across images for small maps) of T tiles, whose transformed
// input V [(m + 2)^2, C, T] and products Mt [(m + 2)^2, O, T] stay in cache.
// Per group and input channel, the tiles' (m + 2)^2 elements are gathered
// (each input row copied once into a zero-bordered row, read at stride m)
// and B^T applied down and across them as flat passes over the T tiles; then
// the (m + 2)^2 sgemms; then per output channel A^T the same way and each
// output row written once with the epilogue. Many groups: each group is one
// task on one thread. Few (small maps): the three steps run one after
// another, each split over the cores (input channels, the sgemms' elements,
// output channels).
#include "kernels/winograd_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

std::atomic<int>& mode_flag() {
  static std::atomic<int> mode{[] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_WINOGRAD");
    const std::string s = e ? e : "1";
    return s == "0" ? 0 : s == "2" ? 2 : s == "4" ? 4 : 1;
  }()};
  return mode;
}

// The 1-D transforms over n lanes, out[r][t] = sum_i T[r][i] in[i][t], written
// out so that zero coefficients cost nothing (without -ffast-math the compiler
// keeps x * 0). G is in float64: the weights are transformed once.
template <int M>
struct Tf;

template <>
struct Tf<2> {
  static constexpr int kA = 4;
  // B^T rows: (1 0 -1 0) (0 1 1 0) (0 -1 1 0) (0 1 0 -1)
  [[gnu::always_inline]] static inline void bt(const float* const* in, float* const* out, int n) {
    const float *d0 = in[0], *d1 = in[1], *d2 = in[2], *d3 = in[3];
    float *o0 = out[0], *o1 = out[1], *o2 = out[2], *o3 = out[3];
#pragma GCC ivdep
    for (int t = 0; t < n; ++t) {
      const float a0 = d0[t], a1 = d1[t], a2 = d2[t], a3 = d3[t];
      o0[t] = a0 - a2;
      o1[t] = a1 + a2;
      o2[t] = a2 - a1;
      o3[t] = a1 - a3;
    }
  }
  // A^T rows: (1 1 1 0) (0 1 -1 -1)
  [[gnu::always_inline]] static inline void at(const float* const* in, float* const* out, int n) {
    const float *d0 = in[0], *d1 = in[1], *d2 = in[2], *d3 = in[3];
    float *o0 = out[0], *o1 = out[1];
#pragma GCC ivdep
    for (int t = 0; t < n; ++t) {
      const float a1 = d1[t], a2 = d2[t];
      o0[t] = d0[t] + a1 + a2;
      o1[t] = a1 - a2 - d3[t];
    }
  }
  static constexpr double kG[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};
};

template <>
struct Tf<4> {
  static constexpr int kA = 6;
  // B^T rows: (4 0 -5 0 1 0) (0 -4 -4 1 1 0) (0 4 -4 -1 1 0) (0 -2 -1 2 1 0) (0 2 -1 -2 1 0) (0 4 0 -5 0 1)
  [[gnu::always_inline]] static inline void bt(const float* const* in, float* const* out, int n) {
    const float *d0 = in[0], *d1 = in[1], *d2 = in[2], *d3 = in[3], *d4 = in[4], *d5 = in[5];
    float *o0 = out[0], *o1 = out[1], *o2 = out[2], *o3 = out[3], *o4 = out[4], *o5 = out[5];
#pragma GCC ivdep
    for (int t = 0; t < n; ++t) {
      const float a0 = d0[t], a1 = d1[t], a2 = d2[t], a3 = d3[t], a4 = d4[t], a5 = d5[t];
      o0[t] = 4.f * a0 - 5.f * a2 + a4;
      o1[t] = (a3 + a4) - 4.f * (a1 + a2);
      o2[t] = (a4 - a3) + 4.f * (a1 - a2);
      o3[t] = (a4 - a2) + 2.f * (a3 - a1);
      o4[t] = (a4 - a2) - 2.f * (a3 - a1);
      o5[t] = 4.f * a1 - 5.f * a3 + a5;
    }
  }
  // A^T rows: (1 1 1 1 1 0) (0 1 -1 2 -2 0) (0 1 1 4 4 0) (0 1 -1 8 -8 1)
  [[gnu::always_inline]] static inline void at(const float* const* in, float* const* out, int n) {
    const float *d0 = in[0], *d1 = in[1], *d2 = in[2], *d3 = in[3], *d4 = in[4], *d5 = in[5];
    float *o0 = out[0], *o1 = out[1], *o2 = out[2], *o3 = out[3];
#pragma GCC ivdep
    for (int t = 0; t < n; ++t) {
      const float a1 = d1[t], a2 = d2[t], a3 = d3[t], a4 = d4[t];
      const float s12 = a1 + a2, d12 = a1 - a2, s34 = a3 + a4, d34 = a3 - a4;
      o0[t] = d0[t] + s12 + s34;
      o1[t] = d12 + 2.f * d34;
      o2[t] = s12 + 4.f * s34;
      o3[t] = d12 + 8.f * d34 + d5[t];
    }
  }
  static constexpr double kG[6][3] = {{0.25, 0, 0},
                                      {-1.0 / 6, -1.0 / 6, -1.0 / 6},
                                      {-1.0 / 6, 1.0 / 6, -1.0 / 6},
                                      {1.0 / 24, 1.0 / 12, 1.0 / 6},
                                      {1.0 / 24, -1.0 / 12, 1.0 / 6},
                                      {0, 0, 1}};
};

struct Plan {
  WinogradGeometry g;
  int TW, TH;  // tiles per row, tile rows per image
  int rows;    // tile rows per group (a group may run across images)
  const float *x, *u, *bias, *residual;
  float* y;
  const mx::array* pack = nullptr;  // u laid out for the serial sgemm's tile (winograd_packed_weights), or null
  std::atomic<bool> packed{false};  // whether a product ran on the pack
  int64_t tile_rows() const { return int64_t{g.N} * TH; }
};

// Tile row ti's input tiles of one channel plane, as S[i][j][t] (t: the
// row's TW tiles at `S`, stride `ts` between (i, j) pairs): element (i, j) of
// tile t is padded input row ti * M + i, column t * M + j. Each input row is
// copied once into a zero-bordered row `pad` (M * TW + 2 floats), then read
// at stride M; everything after runs flat over all the group's tiles.
template <int M>
[[gnu::always_inline]] inline void gather_row(const Plan& p, const float* plane, int ti, float* S, int64_t ts,
                                              float* pad) {
  constexpr int A = M + 2;
  const WinogradGeometry& g = p.g;
  const int TW = p.TW, width = M * TW + 2;
  for (int i = 0; i < A; ++i) {
    float* s = S + i * A * ts;
    const int ih = ti * M - g.ph + i;
    if (ih < 0 || ih >= g.H) {
      for (int j = 0; j < A; ++j) std::fill(s + j * ts, s + j * ts + TW, 0.f);
      continue;
    }
    // Input columns [0, W) land at pad[pw, pw + W); the rest of the row is zero.
    const int lo = std::min(g.pw, width), n = std::max(0, std::min(g.W, width - lo));
    std::fill(pad, pad + lo, 0.f);
    std::memcpy(pad + lo, plane + int64_t{ih} * g.W, n * sizeof(float));
    std::fill(pad + lo + n, pad + width, 0.f);
    for (int j = 0; j < A; ++j) {
      float* d = s + j * ts;
      const float* src = pad + j;
      for (int t = 0; t < TW; ++t) d[t] = src[t * M];
    }
  }
}

// One output row's M phases R[k][t] (t: the row's TW tiles, phase stride
// `ks`) into dst (OW floats): + bias (+ the residual's row), then the clamp.
template <int M>
[[gnu::always_inline]] inline void store_row(const WinogradGeometry& g, const float* R, int64_t ks, float b,
                                             const float* res, float* dst) {
  const int full = g.OW / M, rest = g.OW - full * M;
  if (res) {
    for (int t = 0; t < full; ++t)
      for (int k = 0; k < M; ++k) dst[t * M + k] = R[k * ks + t] + b + res[t * M + k];
    for (int k = 0; k < rest; ++k) dst[full * M + k] = R[k * ks + full] + b + res[full * M + k];
  } else {
    for (int t = 0; t < full; ++t)
      for (int k = 0; k < M; ++k) dst[t * M + k] = R[k * ks + t] + b;
    for (int k = 0; k < rest; ++k) dst[full * M + k] = R[k * ks + full] + b;
  }
  if (g.clamp)
    for (int q = 0; q < g.OW; ++q) dst[q] = std::min(std::max(dst[q], g.lo), g.hi);
}

// Channels [c0, c1) of the group's tile rows [r0, r1) into V [A^2, C, T]:
// per channel the tiles gathered (gather_row), then B^T down the tiles'
// columns and along their rows, each a flat pass over the T tiles.
template <int M>
[[gnu::always_inline]] inline void group_input(const Plan& p, int64_t r0, int64_t r1, int c0, int c1, float* V,
                                               int64_t T) {
  constexpr int A = M + 2;
  thread_local std::vector<float> scratch;
  at_least(scratch, 2 * A * A * T + M * p.TW + 2);
  float *S = scratch.data(), *Z = S + A * A * T, *pad = Z + A * A * T;
  const WinogradGeometry& g = p.g;
  const float* in[A];
  float* out[A];
  for (int c = c0; c < c1; ++c) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / p.TH;
      gather_row<M>(p, p.x + (n * g.C + c) * g.H * g.W, static_cast<int>(r % p.TH), S + (r - r0) * p.TW, T,
                    pad);
    }
    for (int i = 0; i < A; ++i) in[i] = S + i * A * T, out[i] = Z + i * A * T;
    Tf<M>::bt(in, out, A * T);  // Z[u][j] = sum_i B^T[u][i] S[i][j], all j at once
    for (int u = 0; u < A; ++u) {
      for (int j = 0; j < A; ++j) in[j] = Z + (u * A + j) * T;
      for (int v = 0; v < A; ++v) out[v] = V + ((u * A + v) * int64_t{g.C} + c) * T;
      Tf<M>::bt(in, out, T);
    }
  }
}

// The products of elements [e0, e1): Mt[e] = U[e] [O, C] x V[e] [C, T].
void group_gemm(Plan& p, int e0, int e1, const float* V, float* Mt, int64_t T) {
  const WinogradGeometry& g = p.g;
  const SerialSgemmFn gemm = serial_sgemm();
  const int64_t oc = int64_t{g.O} * g.C;
  for (int e = e0; e < e1; ++e) {
    const float* v = V + e * int64_t{g.C} * T;
    float* mt = Mt + e * int64_t{g.O} * T;
    if (p.pack && serial_sgemm_packed(serial_sgemm_pack_at(*p.pack, e), 0, g.O, g.C, false, static_cast<int>(T), 1.f, v,
                                      static_cast<int>(T), 0.f, mt, static_cast<int>(T)))
      p.packed.store(true, std::memory_order_relaxed);
    else
      gemm(0, 0, g.O, static_cast<int>(T), g.C, 1.f, p.u + e * oc, g.C, v, static_cast<int>(T), 0.f, mt,
           static_cast<int>(T));
  }
}

// Output channels [o0, o1) of the group's tile rows [r0, r1) from Mt: per
// channel A^T along the tiles' rows and down their columns (flat passes over
// the T tiles), then each output row written once with the epilogue.
template <int M>
[[gnu::always_inline]] inline void group_output(const Plan& p, int64_t r0, int64_t r1, int o0, int o1,
                                                const float* Mt, int64_t T) {
  constexpr int A = M + 2;
  thread_local std::vector<float> scratch;
  at_least(scratch, (A * M + M * M) * T);
  float *S = scratch.data(), *R = S + A * M * T;
  const WinogradGeometry& g = p.g;
  const float* in[A];
  float* out[A];
  for (int o = o0; o < o1; ++o) {
    for (int u = 0; u < A; ++u) {
      for (int v = 0; v < A; ++v) in[v] = Mt + ((u * A + v) * int64_t{g.O} + o) * T;
      for (int k = 0; k < M; ++k) out[k] = S + (u * M + k) * T;
      Tf<M>::at(in, out, T);
    }
    for (int u = 0; u < A; ++u) in[u] = S + u * M * T;
    for (int q = 0; q < M; ++q) out[q] = R + q * M * T;
    Tf<M>::at(in, out, M * T);  // R[q][k] = sum_u A^T[q][u] S[u][k], all k at once
    const float b = p.bias ? p.bias[o] : 0.f;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / p.TH;
      const int ti = static_cast<int>(r % p.TH), rows = std::min(M, g.OH - ti * M);
      const int64_t first = (n * g.O + o) * g.OH * g.OW + int64_t{ti} * M * g.OW;
      for (int q = 0; q < rows; ++q) {
        const int64_t at = first + int64_t{q} * g.OW;
        store_row<M>(g, R + q * M * T + (r - r0) * p.TW, T, b, p.residual ? p.residual + at : nullptr, p.y + at);
      }
      if (g.act >= 0) unary_cpu_map(static_cast<UnaryKernel>(g.act))(p.y + first, p.y + first, int64_t{rows} * g.OW);
    }
  }
}

// The per-group work compiled for one ISA (the transforms' loops vectorise
// to its width): AVX2 + FMA where the CPU has it, else portable.
template <int M>
struct Work {
  void (*input)(const Plan&, int64_t, int64_t, int, int, float*, int64_t);
  void (*output)(const Plan&, int64_t, int64_t, int, int, const float*, int64_t);
};

#ifdef MLXD_CPU_X86
template <int M>
MLXD_AVX2 void input_avx2(const Plan& p, int64_t r0, int64_t r1, int c0, int c1, float* V, int64_t T) {
  group_input<M>(p, r0, r1, c0, c1, V, T);
}
template <int M>
MLXD_AVX2 void output_avx2(const Plan& p, int64_t r0, int64_t r1, int o0, int o1, const float* Mt, int64_t T) {
  group_output<M>(p, r0, r1, o0, o1, Mt, T);
}
#endif
template <int M>
void input_portable(const Plan& p, int64_t r0, int64_t r1, int c0, int c1, float* V, int64_t T) {
  group_input<M>(p, r0, r1, c0, c1, V, T);
}
template <int M>
void output_portable(const Plan& p, int64_t r0, int64_t r1, int o0, int o1, const float* Mt, int64_t T) {
  group_output<M>(p, r0, r1, o0, o1, Mt, T);
}

template <int M>
Work<M> work() {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) return {input_avx2<M>, output_avx2<M>};
#endif
  return {input_portable<M>, output_portable<M>};
}

// Floats per group (V and Mt together): 1 MB, half a core's L2, unless
// MLX_DELEGATE_WINOGRAD_GROUP_KB says otherwise (tuning runs).
int64_t group_floats() {
  static const int64_t v = [] {
    const char* e = std::getenv("MLX_DELEGATE_WINOGRAD_GROUP_KB");
    const int64_t kb = e ? std::atoll(e) : 0;
    return kb > 0 ? kb * 256 : int64_t{1} << 18;
  }();
  return v;
}

constexpr int64_t kMinTiles = 64;

// Tile rows per group of the convolution's tiles. Groups of at least kMinTiles tiles (where the map has
// them): narrower products run the sgemm far below its peak, and each group reads all the weights again.
int group_rows(const WinogradGeometry& g, int m) {
  const int A = m + 2, TW = (g.OW + m - 1) / m, TH = (g.OH + m - 1) / m;
  const int64_t per_tile = A * A * (int64_t{g.C} + g.O);
  const int64_t fit = group_floats() / (per_tile * TW), least = (kMinTiles + TW - 1) / TW;
  return static_cast<int>(std::clamp<int64_t>(std::max(fit, least), 1, int64_t{g.N} * TH));
}

template <int M>
void run(Plan& p) {
  constexpr int A2 = (M + 2) * (M + 2);
  const Work<M> k = work<M>();
  const WinogradGeometry& g = p.g;
  p.rows = group_rows(g, M);
  const int64_t groups = (p.tile_rows() + p.rows - 1) / p.rows;
  const int threads = cpu_pool_threads();
  auto bounds = [&](int64_t gi) { return std::make_pair(gi * p.rows, std::min(p.tile_rows(), (gi + 1) * p.rows)); };
  if (groups >= 2 * threads) {  // each group one task, in one core's cache
    cpu_kernel_note_call("conv_winograd_groups");
    cpu_parallel_parts(static_cast<int>(groups), [&](int gi) {
      thread_local std::vector<float> V, Mt;
      const auto [r0, r1] = bounds(gi);
      const int64_t T = (r1 - r0) * p.TW;
      at_least(V, A2 * g.C * T);
      at_least(Mt, A2 * g.O * T);
      k.input(p, r0, r1, 0, g.C, V.data(), T);
      group_gemm(p, 0, A2, V.data(), Mt.data(), T);
      k.output(p, r0, r1, 0, g.O, Mt.data(), T);
    });
    return;
  }
  // Few groups: each phase split over the cores.
  cpu_kernel_note_call("conv_winograd_phases");
  thread_local std::vector<float> V, Mt;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const auto [r0, r1] = bounds(gi);
    const int64_t T = (r1 - r0) * p.TW;
    at_least(V, A2 * g.C * T);
    at_least(Mt, A2 * g.O * T);
    float *v = V.data(), *mt = Mt.data();
    cpu_parallel_for(g.C, A2 * T * 4, 1, [&](int64_t c0, int64_t c1) {
      k.input(p, r0, r1, static_cast<int>(c0), static_cast<int>(c1), v, T);
    });
    cpu_parallel_for(A2, 2 * int64_t{g.O} * g.C * T, 1, [&](int64_t e0, int64_t e1) {
      group_gemm(p, static_cast<int>(e0), static_cast<int>(e1), v, mt, T);
    });
    cpu_parallel_for(g.O, A2 * T * 4, 1, [&](int64_t o0, int64_t o1) {
      k.output(p, r0, r1, static_cast<int>(o0), static_cast<int>(o1), mt, T);
    });
  }
}

// U from w for tile M (see winograd_weights), one filter per step, in float64.
template <int M>
void weights(const float* w, int O, int C, float* u) {
  constexpr int A = M + 2;
  const int64_t oc = int64_t{O} * C;
  cpu_parallel_for(oc, A * A * 6, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* k = w + i * 9;
      double t[A][3];  // G k
      for (int r = 0; r < A; ++r)
        for (int j = 0; j < 3; ++j) {
          double s = 0;
          for (int q = 0; q < 3; ++q) s += Tf<M>::kG[r][q] * k[q * 3 + j];
          t[r][j] = s;
        }
      for (int r = 0; r < A; ++r)
        for (int v = 0; v < A; ++v) {
          double s = 0;
          for (int j = 0; j < 3; ++j) s += t[r][j] * Tf<M>::kG[v][j];
          u[(r * A + v) * oc + i] = static_cast<float>(s);
        }
    }
  });
}

}  // namespace

int set_conv_winograd(int mode) {
  if (mode != 0 && mode != 1 && mode != 2 && mode != 4)
    throw std::invalid_argument("set_conv_winograd: mode must be 0 (off), 1 (auto), 2 or 4 (the output tile), got " +
                                std::to_string(mode));
  return mode_flag().exchange(mode, std::memory_order_relaxed);
}

int conv_winograd() { return mode_flag().load(std::memory_order_relaxed); }

int winograd_tile(const WinogradGeometry& g, bool eligible) {
  const int mode = conv_winograd();
  if (mode == 0 || !eligible || serial_sgemm() == nullptr) return 0;
  if (mode == 2 || mode == 4) return mode;
  // The measured gate (see docs/performance.md): F(4x4) where the channels fill the products and the
  // map gives enough tiles; F(2x2) on smaller maps; the im2col path below that.
  // Tiles per product: below ~49 the (m + 2)^2 products are too narrow to pay for reading their weights.
  if (g.C < 32 || g.O < 32) return 0;
  const auto tiles = [&](int m) { return int64_t{g.N} * ((g.OH + m - 1) / m) * ((g.OW + m - 1) / m); };
  if (tiles(4) >= 49) return 4;
  if (tiles(2) >= 49) return 2;
  return 0;
}

int winograd_tile_for(const mx::array& x, const mx::array& w, const std::vector<int>& stride,
                      const std::vector<int>& padding, const std::vector<int>& padding_hi,
                      const std::vector<int>& dilation, int groups, bool has_in_scale) {
  const std::vector<int>& hi = padding_hi.empty() ? padding : padding_hi;
  const auto ones = [](const std::vector<int>& v) { return v.size() == 2 && v[0] == 1 && v[1] == 1; };
  if (x.ndim() != 4 || w.ndim() != 4 || w.shape(2) != 3 || w.shape(3) != 3 || groups != 1 || has_in_scale ||
      !ones(stride) || !ones(dilation) || padding.size() != 2 || hi.size() != 2)
    return 0;
  const WinogradGeometry g = winograd_geometry(x, w, padding, padding_hi);
  if (g.OH < 1 || g.OW < 1 || w.shape(1) != x.shape(1)) return 0;
  return winograd_tile(g, true);
}

WinogradGeometry winograd_geometry(const mx::array& x, const mx::array& w, const std::vector<int>& padding,
                                   const std::vector<int>& padding_hi) {
  const std::vector<int>& hi = padding_hi.empty() ? padding : padding_hi;
  const int OH = x.shape(2) + padding[0] + hi[0] - 2, OW = x.shape(3) + padding[1] + hi[1] - 2;
  return {x.shape(0), x.shape(1), x.shape(2), x.shape(3), w.shape(0), OH, OW, padding[0], padding[1], false, 0.f, 0.f,
          -1};
}

void winograd_weights(const float* w, int O, int C, int m, float* u) {
  if (m != 2 && m != 4) throw std::invalid_argument("winograd_weights: tile must be 2 or 4");
  m == 2 ? weights<2>(w, O, C, u) : weights<4>(w, O, C, u);
}

mx::array winograd_weights(const mx::array& w, int m) {
  if (w.ndim() != 4 || w.shape(2) != 3 || w.shape(3) != 3)
    throw std::invalid_argument("winograd_weights: needs [O, C, 3, 3] weights");
  const int O = w.shape(0), C = w.shape(1), A = m + 2;
  F32RowMajor src(w);
  std::vector<float> u(static_cast<size_t>(A) * A * O * C);
  winograd_weights(src.data(), O, C, m, u.data());
  return mx::array(u.begin(), mx::Shape{A * A, O, C}, mx::float32);
}

int winograd_weights_tile(const mx::array& u, int O, int C) {
  if (u.dtype() != mx::float32 || u.ndim() != 3 || u.shape(1) != O || u.shape(2) != C) return 0;
  return u.shape(0) == 16 ? 2 : u.shape(0) == 36 ? 4 : 0;
}

bool winograd_conv(const WinogradGeometry& g, int m, const float* x, const float* u, const float* bias,
                   const float* residual, float* y, const mx::array* pack) {
  if (m != 2 && m != 4) throw std::invalid_argument("winograd_conv: tile must be 2 or 4");
  Plan p{g, (g.OW + m - 1) / m, (g.OH + m - 1) / m, 1, x, u, bias, residual, y};
  if (pack && pack->ndim() == 2 && pack->shape(0) == (m + 2) * (m + 2) && pack->shape(1) > 0) p.pack = pack;
  m == 2 ? run<2>(p) : run<4>(p);
  return p.packed.load(std::memory_order_relaxed);
}

mx::array winograd_packed_weights(const mx::array& u, int m, const WinogradGeometry& g) {
  if (winograd_weights_tile(u, g.O, g.C) != m || !u.flags().row_contiguous)
    throw std::invalid_argument("winograd_packed_weights: u is not winograd_weights' for this tile and geometry");
  const int64_t T = int64_t{group_rows(g, m)} * ((g.OW + m - 1) / m);
  auto pack = serial_sgemm_pack(u.data<float>(), (m + 2) * (m + 2), g.O, g.C,
                                {g.O, static_cast<int>(std::min<int64_t>(T, 1 << 30))});
  return pack ? *pack : mx::zeros({(m + 2) * (m + 2), 0}, mx::float32);
}

}  // namespace mlxd::rt
