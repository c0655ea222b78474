// Convolution on the CPU (see conv_cpu.h): im2col + sgemm per image and
// group (large products in tiles of output rows, smaller ones in blocks of
// output channels, each tile or block one task on one thread, the weights laid
// out once for the sgemm's tile), Winograd for 3x3 stride-1 convolutions
// (winograd_cpu.cpp), or a direct loop for depthwise (conv_depthwise_cpu.cpp).
#include "kernels/conv_cpu.h"
#include "kernels/conv_cpu_internal.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"
#include "kernels/vec_math_cpu.h"
#include "kernels/winograd_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {
using namespace conv_detail;

// cblas_sgemm as the process resolves it: the BLAS front (cpp/blas_shim.cpp)
// when mlx_delegate installed it, else whichever BLAS is globally visible.
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
SgemmFn sgemm() {
  static const SgemmFn f = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return f;
}
constexpr int kRowMajor = 101, kNoTrans = 111;

struct Tensor {
  const void* data;
  mx::Dtype dtype;
  mx::Shape shape;
  mx::Strides strides;
  bool contiguous;
};

Tensor tensor(const mx::array& a) {
  return {a.data<void>(), a.dtype(), a.shape(), a.strides(), a.flags().row_contiguous};
}

// A's elements as row-major float32: in place when it already is, else
// converted into `store`.
const float* as_f32(const Tensor& t, std::vector<float>& store) {
  if (t.dtype == mx::float32 && t.contiguous) return static_cast<const float*>(t.data);
  CpuRowMajor packed(t.data, mx::size_of(t.dtype), t.shape, t.strides, t.contiguous);
  int64_t n = 1;
  for (int d : t.shape) n *= d;
  store.resize(n);
  cpu_load_f32(packed.data(), t.dtype, 0, n, store.data());
  return store.data();
}

#ifdef MLXD_CPU_X86
// out[ow] = row[2 * ow] for ow in [lo, hi) eight at a time while a vector's
// 16-float read stays below `limit` (the row's end in the plane); returns the
// first ow left to the scalar loop.
MLXD_AVX2 int gather_stride2(const float* row, float* out, int lo, int hi, int64_t limit) {
  int ow = lo;
  for (; ow + 8 <= hi && 2 * int64_t{ow} + 16 <= limit; ow += 8)
    _mm256_storeu_ps(out + ow, vmath::load_strided<2>(row + 2 * int64_t{ow}));
  return ow;
}
#endif

// One im2col row (input channel plane `plane`, tap ki, kj) for output rows
// [oh0, oh1): (oh1 - oh0) * OW values into `out`, zeros where the window reads padding.
void im2col_row(const Geometry& g, const float* plane, int ki, int kj, int oh0, int oh1, float* out) {
  const auto [lo, hi] = valid_range(g.OW, g.W, g.sw, g.pw, kj * g.dw);
  for (int oh = oh0; oh < oh1; ++oh, out += g.OW) {
    const int ih = oh * g.sh - g.ph + ki * g.dh;
    if (ih < 0 || ih >= g.H || lo >= hi) {
      std::fill(out, out + g.OW, 0.f);
      continue;
    }
    std::fill(out, out + lo, 0.f);
    std::fill(out + hi, out + g.OW, 0.f);
    const float* row = plane + int64_t{ih} * g.W - g.pw + kj * g.dw;
    if (g.sw == 1) {
      std::memcpy(out + lo, row + lo, (hi - lo) * sizeof(float));
    } else {
      int ow = lo;
#ifdef MLXD_CPU_X86
      // Stride 2 (strided stems and downsampling convolutions): reads end within this input row.
      if (g.sw == 2 && cpu_use_avx2()) ow = gather_stride2(row, out, lo, hi, int64_t{g.W} + g.pw - kj * g.dw);
#endif
      for (; ow < hi; ++ow) out[ow] = row[int64_t{ow} * g.sw];
    }
  }
}

// cols [Cg * KH * KW, count * OH * OW] (row stride ld) for images first ..
// first + count - 1 and group gi: image i fills columns [i * OH * OW, (i + 1) * OH * OW).
void im2col(const Geometry& g, const float* x, int first, int count, int gi, float* cols, int64_t ld) {
  const int64_t rows = int64_t{g.Cg()} * g.KH * g.KW;
  cpu_parallel_for(rows * count, g.P(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t image = t / rows, r = t % rows;
      const int c = static_cast<int>(r / (g.KH * g.KW)), ki = static_cast<int>(r / g.KW % g.KH),
                kj = static_cast<int>(r % g.KW);
      const float* plane = x + ((first + image) * g.C + int64_t{gi} * g.Cg() + c) * g.H * g.W;
      im2col_row(g, plane, ki, kj, 0, g.OH, cols + r * ld + image * g.P());
    }
  });
}

// Images of fewer output columns than this share one sgemm (their im2col
// columns side by side): a product 49 columns wide (a 7x7 map) runs far below
// the BLAS's peak, and each call has a fixed cost.
// MLX_DELEGATE_CONV_BATCH=0 keeps one sgemm per image (A/B measurements).
int64_t batch_columns() {
  static const int64_t v = [] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_BATCH");
    return e && std::string(e) == "0" ? int64_t{0} : int64_t{1024};
  }();
  return v;
}

// The tiled paths (run_tiled, the channel blocks, the padded depthwise rows):
// on unless MLX_DELEGATE_CONV_TILES=0; set_conv_tiles switches them per call
// for A/B runs in one process.
std::atomic<bool>& tiles_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_TILES");
    return !(e && std::string(e) == "0");
  }()};
  return on;
}

}  // namespace

void conv_detail::finish_rows(const Geometry& g, float* y, int64_t ld, int rows, int64_t count,
                              const float* bias, const float* residual) {
  const float lo = g.clamp ? g.lo : -INFINITY, hi = g.clamp ? g.hi : INFINITY;
  for (int r = 0; r < rows; ++r) {
    float* row = y + r * ld;
    const float b = bias ? bias[r] : 0.f;
    const float* res = residual ? residual + r * ld : nullptr;
#ifdef MLXD_CPU_X86
    if (cpu_use_avx2()) {
      if (bias || res || g.clamp) vmath::add_bias_residual_clamp(row, count, b, res, lo, hi);
      if (ld != count) activate(g, row, count);
      continue;
    }
#endif
    for (int64_t i = 0; i < count; ++i) row[i] = row[i] + b + (res ? res[i] : 0.f);  // as the vector loop
    finish(g, row, count);
  }
#ifdef MLXD_CPU_X86
  // Dense rows take the activation in one call: a 7x7 map's rows are 49 floats, and one call per row
  // (MobileNetV3's last 1x1, 960 of them) cost 8 of its 230 us (2026-12-07).
  if (cpu_use_avx2() && ld == count) activate(g, y, rows * count);
#endif
}

namespace {

// Floats per tile (512 KB): a tile's im2col columns (none for a 1x1 stride-1
// convolution, which reads the input in place) and its output block stay in a
// core's L2 from the copy through the product to the clamp.
constexpr int64_t kTileFloats = int64_t{1} << 17;
// Weights up to this many floats (1 MB) are re-read per tile from cache; larger
// ones (deep layers, whose im2col is small anyway) keep the whole-image product.
constexpr int64_t kTileMaxWeights = int64_t{1} << 18;

// Tiles per image (output-row bands) when the tiled path applies to this per-image product, else 0.
// `direct`: a 1x1 product on the input planes (no im2col). The tile count is rounded up so that the
// images' tiles together divide evenly among the pool's threads, and the bands are of equal height
// (within a row): ResNet-50's 256->1024 1x1 convolution at 14x14 was two tiles of 9 and 5 rows, one
// per thread, its 128->512 at 28x28 four tiles of 9, 9, 9 and 1 rows.
int tile_count(const Geometry& g, bool direct) {
  const int64_t K = int64_t{g.Cg()} * g.KH * g.KW;
  if (!tiles_flag().load(std::memory_order_relaxed) || serial_sgemm() == nullptr) return 0;
  const int64_t per_column = direct ? g.Og() : K;  // what a tile holds per output column
  if (K * g.Og() > kTileMaxWeights || per_column * g.P() <= kTileFloats) return 0;  // one tile: nothing to gain
  const int64_t rows = std::clamp<int64_t>(kTileFloats / (per_column * g.OW), 1, g.OH);
  const int64_t others = int64_t{g.N} * g.groups, threads = cpu_pool_threads();
  int64_t tiles = (g.OH + rows - 1) / rows;
  while ((others * tiles) % threads != 0 && tiles < g.OH) ++tiles;
  return static_cast<int>(tiles);
}

// Whether the Winograd path may take this convolution (3x3, stride 1, undilated, ungrouped, no input
// scale); winograd_tile decides whether it does.
bool winograd_eligible(const Geometry& g, bool has_scale) {
  return g.KH == 3 && g.KW == 3 && g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 && g.groups == 1 && !has_scale;
}

// Images that share one product (their im2col columns side by side): 1 runs the per-image paths.
// Per-image weights (a folded input scale) rule out sharing.
int images_per_product(const Geometry& g, bool per_image_weights) {
  if (per_image_weights) return 1;
  return static_cast<int>(std::min<int64_t>(g.N, std::max<int64_t>(1, (batch_columns() + g.P() - 1) / g.P())));
}

// Blocks of output channels for a one-image product below a tile: one per pool thread (each block's
// sgemm packs the whole [K, P] operand again, so more blocks a thread would read it more often).
int block_parts(int M, int K, int64_t P) {
  return int64_t{M} * K * P >= kCpuMinParallel ? cpu_pool_threads() : 1;
}

// One image's product in `tiles` bands of output rows, each on one thread:
// im2col of the tile into a per-thread buffer (unless `direct`), the bias /
// residual written into the tile's output columns, a single-threaded sgemm
// adding onto them, then the clamp. The whole [K, OH * OW] im2col matrix (9x
// the input for a 3x3 convolution) never goes through memory, and the output
// is written once instead of once per pass.
void run_tiled(const Geometry& g, int tiles, bool direct, const float* x, const float* w, int64_t w_image,
               const float* bias, const float* residual, float* y, const mx::array* pack, std::atomic<bool>& packed) {
  const int K = g.Cg() * g.KH * g.KW, M = g.Og();
  const int64_t P = g.P();
  const SerialSgemmFn gemm = serial_sgemm();
  const int64_t items = int64_t{g.N} * g.groups * tiles;
  const int max_rows = (g.OH + tiles - 1) / tiles;
  cpu_parallel_for(items, int64_t{K} * M * max_rows * g.OW, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> cols;
    for (int64_t t = begin; t < end; ++t) {
      const int tile = static_cast<int>(t % tiles), gi = static_cast<int>(t / tiles % g.groups);
      const int n = static_cast<int>(t / tiles / g.groups);
      const int oh0 = tile * g.OH / tiles, oh1 = (tile + 1) * g.OH / tiles;
      const int T = (oh1 - oh0) * g.OW;
      const float* xg = x + (int64_t{n} * g.C + int64_t{gi} * g.Cg()) * g.H * g.W;
      if (!direct) {
        at_least(cols, int64_t{K} * T);
        for (int r = 0; r < K; ++r) {
          const int c = r / (g.KH * g.KW), ki = r / g.KW % g.KH, kj = r % g.KW;
          im2col_row(g, xg + int64_t{c} * g.H * g.W, ki, kj, oh0, oh1, cols.data() + int64_t{r} * T);
        }
      }
      const int64_t first = (int64_t{n} * g.O + int64_t{gi} * M) * P + int64_t{oh0} * g.OW;
      float* yt = y + first;
      // direct: the input's planes are B in place (row stride P), from the tile's first column.
      const float* b = direct ? xg + int64_t{oh0} * g.OW : cols.data();
      const int ldb = direct ? static_cast<int>(P) : T;
      if (pack && serial_sgemm_packed(serial_sgemm_pack_at(*pack, gi), 0, M, K, false, T, 1.f, b, ldb, 0.f, yt,
                                      static_cast<int>(P)))
        packed.store(true, std::memory_order_relaxed);
      else
        gemm(0, 0, M, T, K, 1.f, w + n * w_image + int64_t{gi} * M * K, K, b, ldb, 0.f, yt, static_cast<int>(P));
      finish_rows(g, yt, P, M, T, bias ? bias + gi * M : nullptr, residual ? residual + first : nullptr);
    }
  });
}

// An input scale per image and channel (x * s[n, c], a squeeze-excite gate)
// folded into whichever operand is smaller: a per-image copy of the weights
// (returns the stride between the copies; w points at them), else a scaled
// copy of the input (returns 0; x points at it). One parallel pass either way,
// instead of a broadcast multiply writing a new activation before the call.
int64_t fold_scale(const Geometry& g, const float* s, const float*& x, const float*& w, std::vector<float>& buf) {
  const int taps = g.KH * g.KW, Cg = g.Cg(), Og = g.Og();
  const int64_t per_o = int64_t{Cg} * taps, w_n = g.O * per_o, plane = int64_t{g.H} * g.W;
  if (w_n <= g.C * plane) {
    buf.resize(g.N * w_n);
    const float* src = w;
    cpu_parallel_for(int64_t{g.N} * g.O, per_o, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / g.O, o = t % g.O;
        const float* sc = s + n * g.C + o / Og * Cg;  // the scales of this output channel's group
        const float* from = src + o * per_o;
        float* to = buf.data() + t * per_o;
        for (int c = 0; c < Cg; ++c)
          for (int k = 0; k < taps; ++k) to[c * taps + k] = from[c * taps + k] * sc[c];
      }
    });
    w = buf.data();
    return w_n;
  }
  buf.resize(int64_t{g.N} * g.C * plane);
  const float* src = x;
  cpu_parallel_for(int64_t{g.N} * g.C, plane, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float sv = s[t], *from = src + t * plane;
      float* to = buf.data() + t * plane;
      for (int64_t i = 0; i < plane; ++i) to[i] = from[i] * sv;
    }
  });
  x = buf.data();
  return 0;
}

struct ConvCall {
  Tensor x, w;
  std::optional<Tensor> bias, residual, scale, wino;  // wino: the weights in the Winograd domain
  std::optional<mx::array> pack;  // the weights laid out for the serial sgemm's tile (conv_pack_weights)
  void* y;
  mx::Dtype out_dtype;
  Geometry g;
};

void run_conv(const ConvCall& c) {
  const Geometry& g = c.g;
  std::vector<float> xs, ws, bs, rs, ss, ys;
  thread_local std::vector<float> cols;  // im2col's, kept: a fresh vector was zero-filled each call
  const float* x = as_f32(c.x, xs);
  const float* w = as_f32(c.w, ws);
  const float* bias = c.bias ? as_f32(*c.bias, bs) : nullptr;
  const float* residual = c.residual ? as_f32(*c.residual, rs) : nullptr;
  // Kept per thread across calls: a fresh vector of a few hundred KB is a fresh mapping (page faults) each call.
  thread_local std::vector<float> scaled;
  const int64_t w_image = c.scale ? fold_scale(g, as_f32(*c.scale, ss), x, w, scaled) : 0;
  const int64_t out_n = int64_t{g.N} * g.O * g.P();
  float* y = static_cast<float*>(c.y);
  if (c.out_dtype != mx::float32) {
    ys.resize(out_n);
    y = ys.data();
  }
  const WinogradGeometry wg{g.N, g.C, g.H, g.W, g.O, g.OH, g.OW, g.ph, g.pw, g.clamp, g.lo, g.hi, g.act};
  if (direct_applies(g, w_image)) {  // few input channels (a stem)
    cpu_kernel_note_call("conv_direct");
    direct(g, x, w, bias, residual, y);
  } else if (const int m = winograd_tile(wg, winograd_eligible(g, c.scale.has_value()))) {  // else (switched off, another shape): im2col below
    cpu_kernel_note_call(m == 2 ? "conv_winograd2" : "conv_winograd4");
    const bool given = c.wino && c.wino->contiguous && c.wino->shape[0] == (m + 2) * (m + 2);
    thread_local std::vector<float> made;  // weights that are not a constant (or another tile): each call
    if (!given) {
      at_least(made, int64_t{m + 2} * (m + 2) * g.O * g.C);
      winograd_weights(w, g.O, g.C, m, made.data());
    }
    const float* u = given ? static_cast<const float*>(c.wino->data) : made.data();
    if (winograd_conv(wg, m, x, u, bias, residual, y, given && c.pack ? &*c.pack : nullptr))
      cpu_kernel_note_call("conv_packed_weights");
  } else if (g.Cg() == 1) {
    depthwise(g, x, w, w_image, bias, residual, y);
  } else {
    const bool direct = g.KH == 1 && g.KW == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0 &&
                        g.OH == g.H && g.OW == g.W;
    const int K = g.Cg() * g.KH * g.KW, M = g.Og();
    const int64_t P = g.P();
    const int nb = images_per_product(g, w_image != 0);
    const int tiles = nb != 1 ? 0 : tile_count(g, direct);
    // The packed weights serve the per-image products when the weights are shared by the images.
    const mx::array* pack = c.pack && c.pack->shape(0) == g.groups && !w_image ? &*c.pack : nullptr;
    std::atomic<bool> packed{false};  // whether a product ran on them (a stale pack is skipped)
    if (tiles > 0) {
      cpu_kernel_note_call("conv_tiled");
      run_tiled(g, tiles, direct, x, w, w_image, bias, residual, y, pack, packed);
    } else if (nb == 1) {  // per image: the sgemm writes the result in place
      if (!direct) at_least(cols, int64_t{K} * P);
      // Blocks of output channels, each on one thread (init, product, clamp in one task): one
      // hand-off to the pool per product instead of three. Off with the tiles (A/B).
      const bool blocked = tiles_flag().load(std::memory_order_relaxed) && serial_sgemm() != nullptr;
      if (blocked) cpu_kernel_note_call("conv_row_blocks");
      for (int n = 0; n < g.N; ++n) {
        for (int gi = 0; gi < g.groups; ++gi) {
          const float* xg = x + (int64_t{n} * g.C + int64_t{gi} * g.Cg()) * g.H * g.W;
          const int64_t first = (int64_t{n} * g.O + int64_t{gi} * M) * P;
          float* yg = y + first;
          if (!direct) im2col(g, x, n, 1, gi, cols.data(), P);
          const float* bmat = direct ? xg : cols.data();
          const float* wg = w + n * w_image + int64_t{gi} * M * K;
          if (blocked) {  // one pass over blocks of output channels: sgemm, then bias / residual and clamp
            const int parts = block_parts(M, K, P);
            const float* panels = pack ? serial_sgemm_pack_at(*pack, gi) : nullptr;
            // Blocks of whole panels of the packed weights (else 16-channel groups), the last to M.
            const int align = panels ? serial_sgemm_pack_align(panels) : 16;
            cpu_parallel_parts(parts, [&](int part) {
              int64_t lo = int64_t{M} * part / parts, hi = int64_t{M} * (part + 1) / parts;
              lo -= lo % align;
              hi = part + 1 == parts ? M : hi - hi % align;
              if (lo >= hi) return;
              const int rows = static_cast<int>(hi - lo);
              if (panels && serial_sgemm_packed(panels, static_cast<int>(lo), rows, K, false, static_cast<int>(P), 1.f,
                                                bmat, static_cast<int>(P), 0.f, yg + lo * P, static_cast<int>(P)))
                packed.store(true, std::memory_order_relaxed);
              else
                serial_sgemm()(0, 0, rows, static_cast<int>(P), K, 1.f, wg + lo * K, K, bmat, static_cast<int>(P), 0.f,
                               yg + lo * P, static_cast<int>(P));
              finish_rows(g, yg + lo * P, P, rows, P, bias ? bias + gi * M + lo : nullptr,
                          residual ? residual + first + lo * P : nullptr);
            });
            continue;
          }
          // The sgemm adds onto bias + residual (beta 1), so neither costs a pass of its own.
          if (bias || residual) {
            cpu_parallel_for(M, residual ? 2 * P : P, 1, [&](int64_t b, int64_t e) {
              for (int64_t o = b; o < e; ++o)
                init_plane(g, yg + o * P, bias ? bias[gi * M + o] : 0.f,
                           residual ? residual + first + o * P : nullptr);
            });
          }
          sgemm()(kRowMajor, kNoTrans, kNoTrans, M, static_cast<int>(P), K, 1.f, wg, K,
                  direct ? xg : cols.data(), static_cast<int>(P), bias || residual ? 1.f : 0.f, yg,
                  static_cast<int>(P));
          if (has_epilogue(g))
            cpu_parallel_for(M, P, 1, [&](int64_t b, int64_t e) { finish(g, yg + b * P, (e - b) * P); });
        }
      }
    }
    if (packed.load(std::memory_order_relaxed)) cpu_kernel_note_call("conv_packed_weights");
    if (nb != 1) {  // nb images per sgemm into z [M, nb * P]; one pass moves it to NCHW with bias, residual, clamp
      at_least(cols, int64_t{K} * nb * P);
      thread_local std::vector<float> kept;  // not zeroed per call: the sgemm writes all of it
      at_least(kept, int64_t{M} * nb * P);
      float* z = kept.data();  // (the pool's threads read it: not through the thread_local's name, theirs)
      for (int n0 = 0; n0 < g.N; n0 += nb) {
        const int count = std::min(nb, g.N - n0);
        const int64_t ld = count * P;
        for (int gi = 0; gi < g.groups; ++gi) {
          im2col(g, x, n0, count, gi, cols.data(), ld);
          sgemm()(kRowMajor, kNoTrans, kNoTrans, M, static_cast<int>(ld), K, 1.f, w + int64_t{gi} * M * K, K,
                  cols.data(), static_cast<int>(ld), 0.f, z, static_cast<int>(ld));
          cpu_parallel_for(int64_t{count} * M, residual ? 3 * P : 2 * P, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
              const int64_t image = t / M, o = t % M;
              const int64_t at = ((n0 + image) * g.O + int64_t{gi} * M + o) * P;
              const float* src = z + o * ld + image * P;
              float* dst = y + at;
              const float bv = bias ? bias[gi * M + o] : 0.f;
              if (residual) {
                for (int64_t q = 0; q < P; ++q) dst[q] = src[q] + bv + residual[at + q];
              } else {
                for (int64_t q = 0; q < P; ++q) dst[q] = src[q] + bv;
              }
              finish(g, dst, P);
            }
          });
        }
      }
    }
  }
  if (c.out_dtype != mx::float32) cpu_store_f32(y, c.out_dtype, 0, out_n, c.y);
}

const ChainableKernel kConvCpuChainable{"ConvCpu"};  // kernel_chain.h

class ConvCpu : public mx::UnaryPrimitive {
 public:
  ConvCpu(mx::Stream s, Geometry g, bool has_bias, bool has_residual, bool has_scale, bool has_wino, bool has_pack)
      : mx::UnaryPrimitive(s), g_(g), has_bias_(has_bias), has_residual_(has_residual), has_scale_(has_scale),
        has_wino_(has_wino), has_pack_(has_pack) {}

  // in: x [N, C, H, W], w [O, C/g, KH, KW], then the bias [O], the residual
  // [N, O, OH, OW], the input scale [N, C], the Winograd weights and the packed weights when present;
  // any strides.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    Geometry g = g_;
    g.N = in[0].shape(0);
    ConvCall c{tensor(in[0]), tensor(in[1]), {}, {}, {}, {}, {}, out.data<void>(), out.dtype(), g};
    size_t i = 2;
    if (has_bias_) c.bias = tensor(in[i++]);
    if (has_residual_) c.residual = tensor(in[i++]);
    if (has_scale_) c.scale = tensor(in[i++]);
    if (has_wino_) c.wino = tensor(in[i++]);
    if (has_pack_) c.pack = in[i];
    cpu_kernel_note_call(g.Cg() == 1 ? "conv_depthwise" : "conv_gemm");
    encoder.dispatch([c = std::move(c)] { run_conv(c); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ConvCpu runs on the CPU only");
  }
  const char* name() const override { return "ConvCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ConvCpu&>(other);
    // The ints (the activation's included) compared as one block (no padding among them), then the clamp.
    return std::memcmp(&g_, &o.g_, offsetof(Geometry, clamp)) == 0 && g_.clamp == o.g_.clamp &&
           g_.lo == o.g_.lo && g_.hi == o.g_.hi && has_bias_ == o.has_bias_ &&
           has_residual_ == o.has_residual_ && has_scale_ == o.has_scale_ && has_wino_ == o.has_wino_ &&
           has_pack_ == o.has_pack_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), g_.O, g_.OH, g_.OW}};
  }

 private:
  Geometry g_;
  bool has_bias_, has_residual_, has_scale_, has_wino_, has_pack_;
};

}  // namespace

void set_conv_tiles(bool on) { tiles_flag().store(on, std::memory_order_relaxed); }
bool conv_tiles() { return tiles_flag().load(std::memory_order_relaxed); }

namespace {

int out_size(int in, int k, int s, int lo, int hi, int d) { return (in + lo + hi - d * (k - 1) - 1) / s + 1; }

}  // namespace

bool conv_cpu_applies(const mx::array& x, const mx::array& w, const mx::array* bias, int groups,
                      const mx::array* residual, const mx::array* in_scale) {
  if (!cpu_kernels_active() || sgemm() == nullptr || groups < 1) return false;
  if (!cpu_kernel_dtype_ok(x) || w.dtype() != x.dtype() || w.size() == 0) return false;
  if ((x.ndim() != 3 && x.ndim() != 4) || w.ndim() != x.ndim()) return false;
  if (residual && (residual->dtype() != x.dtype() || residual->ndim() != x.ndim())) return false;
  if (in_scale && in_scale->dtype() != x.dtype()) return false;
  return !bias || (cpu_kernel_dtype_ok(*bias) && bias->size() == static_cast<size_t>(w.shape(0)));
}

namespace {

// The geometry of conv{1,2}d(x, w) (a 1-D convolution as a 2-D one over a height-1 image), without the
// epilogue; throws std::invalid_argument for operands no convolution has.
Geometry make_geometry(const mx::array& x, const mx::array& w, const std::vector<int>& stride,
                       const std::vector<int>& padding, const std::vector<int>& padding_hi,
                       const std::vector<int>& dilation, int groups) {
  const bool one_d = x.ndim() == 3;
  const size_t nd = one_d ? 1 : 2;
  const std::vector<int>& pad_hi = padding_hi.empty() ? padding : padding_hi;
  if (stride.size() != nd || padding.size() != nd || dilation.size() != nd || pad_hi.size() != nd)
    throw std::invalid_argument("conv: stride, padding and dilation need one entry per spatial axis");
  // A 1-D convolution is a 2-D one over a height-1 image.
  auto at = [&](const std::vector<int>& v, int axis, int fill) { return one_d ? (axis ? v[0] : fill) : v[axis]; };
  // ph / pw: the low side's padding; the high side's only sets the output size (the kernel
  // bounds every read by the input's extent).
  Geometry g{x.shape(0), x.shape(1), one_d ? 1 : x.shape(2), x.shape(-1), w.shape(0), one_d ? 1 : w.shape(2),
             w.shape(-1), 0, 0, at(stride, 0, 1), at(stride, 1, 1), at(padding, 0, 0), at(padding, 1, 0),
             at(dilation, 0, 1), at(dilation, 1, 1), groups, -1, false, 0.f, 0.f};
  const int phh = at(pad_hi, 0, 0), pwh = at(pad_hi, 1, 0);
  if (g.C % groups || g.O % groups || w.shape(1) != g.C / groups)
    throw std::invalid_argument("conv: weight " + std::to_string(w.shape(0)) + "x" + std::to_string(w.shape(1)) +
                                " does not fit " + std::to_string(g.C) + " input channels in " +
                                std::to_string(groups) + " groups");
  if (std::min({g.sh, g.sw, g.dh, g.dw}) < 1 || std::min({g.ph, g.pw, phh, pwh}) < 0)
    throw std::invalid_argument("conv: stride and dilation must be positive, padding non-negative");
  if (g.H + g.ph + phh < g.dh * (g.KH - 1) + 1 || g.W + g.pw + pwh < g.dw * (g.KW - 1) + 1)
    throw std::invalid_argument("conv: kernel is larger than the padded input");
  g.OH = out_size(g.H, g.KH, g.sh, g.ph, phh, g.dh);
  g.OW = out_size(g.W, g.KW, g.sw, g.pw, pwh, g.dw);
  return g;
}

}  // namespace

mx::array conv_cpu(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                   const std::vector<int>& stride, const std::vector<int>& padding, const std::vector<int>& dilation,
                   int groups, std::optional<std::pair<float, float>> clamp, const std::vector<int>& padding_hi,
                   const std::optional<mx::array>& residual, std::optional<UnaryKernel> act,
                   const std::optional<mx::array>& in_scale, const std::optional<mx::array>& winograd_w,
                   const std::optional<mx::array>& packed_w) {
  if (!conv_cpu_applies(x, w, bias ? &*bias : nullptr, groups, residual ? &*residual : nullptr,
                        in_scale ? &*in_scale : nullptr))
    throw std::invalid_argument("conv_cpu: operands it does not take");
  const bool one_d = x.ndim() == 3;
  Geometry g = make_geometry(x, w, stride, padding, padding_hi, dilation, groups);
  g.act = act ? static_cast<int>(*act) : -1;
  g.clamp = clamp.has_value();
  g.lo = clamp ? clamp->first : 0.f;
  g.hi = clamp ? clamp->second : 0.f;
  std::vector<mx::array> inputs{x, w};
  if (bias) inputs.push_back(mx::flatten(*bias));
  if (residual) {
    const mx::Shape want = one_d ? mx::Shape{g.N, g.O, g.OW} : mx::Shape{g.N, g.O, g.OH, g.OW};
    if (residual->shape() != want) throw std::invalid_argument("conv: the residual does not have the output's shape");
    inputs.push_back(one_d ? mx::reshape(*residual, {g.N, g.O, g.OH, g.OW}) : *residual);
  }
  if (in_scale) {
    if (in_scale->size() != static_cast<size_t>(g.N) * g.C)
      throw std::invalid_argument("conv: the input scale needs one value per image and input channel");
    inputs.push_back(mx::reshape(*in_scale, {g.N, g.C}));
  }
  if (winograd_w && winograd_weights_tile(*winograd_w, g.O, g.C) == 0)
    throw std::invalid_argument("conv: Winograd weights of another shape than the convolution's");
  if (winograd_w) inputs.push_back(*winograd_w);
  // The pack: one per group (the per-image products), or one per Winograd element (the Winograd
  // weights' products); anything else (or no floats: the products run on MKL) is left out.
  const int packs = winograd_w ? winograd_w->shape(0) : groups;
  const bool pack = packed_w && packed_w->dtype() == mx::float32 && packed_w->ndim() == 2 &&
                    packed_w->shape(0) == packs && packed_w->size() > 0;
  if (pack) inputs.push_back(*packed_w);
  auto prim = std::make_shared<ConvCpu>(mx::default_stream(mx::Device::cpu), g, bias.has_value(), residual.has_value(),
                                        in_scale.has_value(), winograd_w.has_value(), pack);
  auto y = mx::array({g.N, g.O, g.OH, g.OW}, x.dtype(), std::move(prim), std::move(inputs));
  return one_d ? mx::reshape(y, {g.N, g.O, g.OW}) : y;
}

std::optional<SgemmPackHints> conv_pack_hints(const mx::array& x, const mx::array& w,
                                                   const std::vector<int>& stride, const std::vector<int>& padding,
                                                   const std::vector<int>& padding_hi,
                                                   const std::vector<int>& dilation, int groups, bool has_in_scale) {
  if (has_in_scale || !conv_cpu_applies(x, w, nullptr, groups)) return std::nullopt;
  Geometry g;
  try {
    g = make_geometry(x, w, stride, padding, padding_hi, dilation, groups);
  } catch (const std::invalid_argument&) {
    return std::nullopt;  // conv_cpu reports it
  }
  const WinogradGeometry wg{g.N, g.C, g.H, g.W, g.O, g.OH, g.OW, g.ph, g.pw, false, 0.f, 0.f, -1};
  if (g.Cg() == 1 || winograd_tile(wg, winograd_eligible(g, false)) || images_per_product(g, false) != 1)
    return std::nullopt;
  const bool direct = g.KH == 1 && g.KW == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0 && g.OH == g.H &&
                      g.OW == g.W;
  const int M = g.Og(), K = g.Cg() * g.KH * g.KW;
  if (const int tiles = tile_count(g, direct)) return SgemmPackHints{M, (g.OH + tiles - 1) / tiles * g.OW};
  if (!tiles_flag().load(std::memory_order_relaxed) || serial_sgemm() == nullptr) return std::nullopt;
  return SgemmPackHints{M / block_parts(M, K, g.P()), static_cast<int>(g.P())};
}

mx::array conv_pack_weights(const mx::array& w, int groups, SgemmPackHints hints) {
  if (groups < 1 || w.shape(0) % groups) throw std::invalid_argument("conv_pack_weights: groups do not divide O");
  const int M = w.shape(0) / groups, K = static_cast<int>(w.size() / w.shape(0));
  F32RowMajor src(w);
  auto pack = serial_sgemm_pack(src.data(), groups, M, K, hints);
  return pack ? *pack : mx::zeros({groups, 0}, mx::float32);
}

}  // namespace mlxd::rt
