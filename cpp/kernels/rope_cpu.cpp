// RoPE on the CPU: the angles are computed the way MLX's composed fallback
// computes them (float32 positions times float32 inverse frequencies, libm
// cos / sin), tabulated once per call for the L positions and reused by every
// row of every head; rows are then rotated in float32 and split across the
// cores when the call is large (prefill).
#include "kernels/rope_cpu.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// Everything one call reads, captured when the node is evaluated; the values
// behind the pointers are read only when the task runs (earlier tasks on the
// stream may still be writing them).
struct RopeCall {
  const void* x;
  mx::Dtype dtype;
  mx::Shape shape;
  mx::Strides strides;
  bool row_contiguous;
  void* y;
  int dims;
  bool traditional;
  float base, scale;
  int offset;                    // used when offset_ptr is null
  const void* offset_ptr;        // one-element integer array
  mx::Dtype offset_type;
  const void* freqs;             // inverse frequencies [dims / 2], or null: from base
  mx::Dtype freqs_type;
  int64_t freqs_stride;

  int64_t D() const { return shape.back(); }
  int64_t L() const { return shape[shape.size() - 2]; }
  int64_t rows() const {
    int64_t n = 1;
    for (size_t k = 0; k + 1 < shape.size(); ++k) n *= shape[k];
    return n;
  }

  // Element offset of row r (row-major over the leading axes) in x.
  int64_t row_offset(int64_t r) const {
    if (row_contiguous) return r * D();
    int64_t off = 0;
    for (int k = static_cast<int>(shape.size()) - 2; k >= 0; --k) {
      off += (r % shape[k]) * strides[k];
      r /= shape[k];
    }
    return off;
  }
};

void run_rope(const RopeCall& c) {
  const int64_t first = c.offset_ptr ? rope_read_position(c.offset_ptr, c.offset_type) : c.offset;
  std::vector<float> cos_t, sin_t;
  rope_angle_table(c.L(), first, c.scale, rope_inverse_frequencies(c.dims, c.base, c.freqs, c.freqs_type, c.freqs_stride),
                   cos_t, sin_t);
  const int half = c.dims / 2;
  const int64_t D = c.D(), L = c.L(), d_stride = c.strides.back();
  // float32 rows with unit stride go straight from x to y; others through a float32 row.
  const bool direct = c.dtype == mx::float32 && d_stride == 1;
  cpu_parallel_for(c.rows(), D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(direct ? 0 : D);
    for (int64_t r = begin; r < end; ++r) {
      const float* cos_r = cos_t.data() + (r % L) * half;
      const float* sin_r = sin_t.data() + (r % L) * half;
      const int64_t src = c.row_offset(r);
      if (direct) {
        const float* x = static_cast<const float*>(c.x) + src;
        float* y = static_cast<float*>(c.y) + r * D;
        rope_rotate_row(x, y, cos_r, sin_r, half, c.traditional);
        std::memcpy(y + c.dims, x + c.dims, (D - c.dims) * sizeof(float));
        continue;
      }
      if (d_stride == 1) {
        cpu_load_f32(c.x, c.dtype, src, D, buf.data());
      } else {
        for (int64_t j = 0; j < D; ++j) cpu_load_f32(c.x, c.dtype, src + j * d_stride, 1, &buf[j]);
      }
      rope_rotate_row(buf.data(), buf.data(), cos_r, sin_r, half, c.traditional);
      cpu_store_f32(buf.data(), c.dtype, r * D, D, c.y);
    }
  });
}

const ChainableKernel kRopeCpuChainable{"RopeCpu"};  // kernel_chain.h

class RopeCpu : public mx::UnaryPrimitive {
 public:
  RopeCpu(mx::Stream s, int dims, bool traditional, float base, float scale, int offset, bool offset_input,
          bool freqs_input)
      : mx::UnaryPrimitive(s),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        offset_(offset),
        offset_input_(offset_input),
        freqs_input_(freqs_input) {}

  // in: x, then the offset array and the inverse frequencies when present.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto& x = in[0];
    RopeCall c{x.data<void>(), x.dtype(), x.shape(), x.strides(), x.flags().row_contiguous, out.data<void>(),
               dims_, traditional_, base_, scale_, offset_, nullptr, mx::int32, nullptr, mx::float32, 0};
    size_t next = 1;
    if (offset_input_) {
      c.offset_ptr = in[next].data<void>();
      c.offset_type = in[next++].dtype();
    }
    if (freqs_input_) {
      const auto& f = in[next];
      c.freqs = f.data<void>();
      c.freqs_type = f.dtype();
      c.freqs_stride = f.ndim() ? f.strides().back() : 0;
    }
    cpu_kernel_note_call("rope");
    encoder.dispatch([c = std::move(c)] { run_rope(c); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RopeCpu runs on the CPU only");
  }
  const char* name() const override { return "RopeCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeCpu&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_ && offset_input_ == o.offset_input_ && freqs_input_ == o.freqs_input_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
  bool offset_input_, freqs_input_;
};

}  // namespace

// Reads element 0 of a (non-empty) integer array.
int64_t rope_read_position(const void* p, mx::Dtype t) {
  if (t == mx::int32) return *static_cast<const int32_t*>(p);
  if (t == mx::int64) return *static_cast<const int64_t*>(p);
  if (t == mx::uint32) return *static_cast<const uint32_t*>(p);
  if (t == mx::uint64) return static_cast<int64_t>(*static_cast<const uint64_t*>(p));
  if (t == mx::int16) return *static_cast<const int16_t*>(p);
  if (t == mx::uint16) return *static_cast<const uint16_t*>(p);
  if (t == mx::int8) return *static_cast<const int8_t*>(p);
  if (t == mx::uint8) return *static_cast<const uint8_t*>(p);
  throw std::invalid_argument("rope offset must be an integer array");
}

// MLX's inverse frequencies in float32: exp(-i * (log(base) / half)), or the
// given ones through the two reciprocals of MLX's path (exec passes periods =
// 1 / inv_freq, the fallback takes 1 / periods).
std::vector<float> rope_inverse_frequencies(int dims, float base, const void* freqs, mx::Dtype freqs_type,
                                            int64_t freqs_stride) {
  const int half = dims / 2;
  std::vector<float> inv(half);
  if (freqs) {
    for (int i = 0; i < half; ++i) {
      float f;
      cpu_load_f32(freqs, freqs_type, i * freqs_stride, 1, &f);
      inv[i] = 1.f / (1.f / f);
    }
    return inv;
  }
  const float step = std::log(base) / static_cast<float>(half);
  for (int i = 0; i < half; ++i) inv[i] = std::exp(-static_cast<float>(i) * step);
  return inv;
}

void rope_angle_table(int64_t L, int64_t first, float scale, const std::vector<float>& inv, std::vector<float>& cos_t,
                      std::vector<float>& sin_t) {
  const int half = static_cast<int>(inv.size());
  cos_t.resize(L * half);
  sin_t.resize(L * half);
  cpu_parallel_for(L, 16 * half, 1, [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const float pos = (static_cast<float>(l) + static_cast<float>(first)) * scale;
      for (int i = 0; i < half; ++i) {
        const float theta = pos * inv[i];
        cos_t[l * half + i] = std::cos(theta);
        sin_t[l * half + i] = std::sin(theta);
      }
    }
  });
}

void rope_rotate_row(const float* x, float* y, const float* cos_r, const float* sin_r, int half, bool traditional) {
  if (traditional) {  // pairs (x0, x1), (x2, x3), ...
    for (int i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[2 * i] = a * cos_r[i] - b * sin_r[i];
      y[2 * i + 1] = a * sin_r[i] + b * cos_r[i];
    }
    return;
  }
  for (int i = 0; i < half; ++i) {  // halves (x[:half], x[half:dims])
    const float a = x[i], b = x[i + half];
    y[i] = a * cos_r[i] - b * sin_r[i];
    y[i + half] = a * sin_r[i] + b * cos_r[i];
  }
}

bool rope_cpu_applies(const mx::array& x, const mx::array* inv_freq) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x) || x.ndim() < 2) return false;
  return !inv_freq || cpu_kernel_dtype_ok(*inv_freq);
}

mx::array rope_cpu(const mx::array& x, int dims, bool traditional, float base, float scale, const RopeOffset& offset,
                   const std::optional<mx::array>& inv_freq) {
  if (dims <= 0 || dims % 2 || dims > x.shape(-1)) throw std::invalid_argument("rope: bad dims");
  if (inv_freq && static_cast<int>(inv_freq->size()) != dims / 2)
    throw std::invalid_argument("rope: inv_freq must have dims / 2 elements");
  std::vector<mx::array> inputs{x};
  const auto* at = std::get_if<mx::array>(&offset);
  if (at) {
    if (at->size() != 1 || !mx::issubdtype(at->dtype(), mx::integer))
      throw std::invalid_argument("rope offset must be a one-element integer array");
    inputs.push_back(*at);
  }
  if (inv_freq) inputs.push_back(mx::flatten(*inv_freq));
  const int first = at ? 0 : std::get<int>(offset);
  auto prim = std::make_shared<RopeCpu>(mx::default_stream(mx::Device::cpu), dims, traditional, base, scale, first,
                                        at != nullptr, inv_freq.has_value());
  return mx::array(x.shape(), x.dtype(), std::move(prim), std::move(inputs));
}

}  // namespace mlxd::rt
