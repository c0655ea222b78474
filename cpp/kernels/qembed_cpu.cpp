// Quantized embedding rows on the CPU (see qembed_cpu.h): each row's groups unpacked and scaled in
// float32 into a per-thread buffer, then stored in the output dtype; rows split across the cores.
#include "kernels/qembed_cpu.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

struct Table {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  mx::Dtype scale_type;
  int64_t rows, words, k;  // table rows, words per row, values per row
  int group_size, bits;
};

int64_t index_at(const void* idx, mx::Dtype type, int64_t i) {
  switch (type) {
    case mx::int64: return static_cast<const int64_t*>(idx)[i];
    case mx::int32: return static_cast<const int32_t*>(idx)[i];
    case mx::uint32: return static_cast<const uint32_t*>(idx)[i];
    case mx::int16: return static_cast<const int16_t*>(idx)[i];
    case mx::uint16: return static_cast<const uint16_t*>(idx)[i];
    case mx::int8: return static_cast<const int8_t*>(idx)[i];
    case mx::uint8: return static_cast<const uint8_t*>(idx)[i];
    default: return static_cast<int64_t>(static_cast<const uint64_t*>(idx)[i]);  // uint64
  }
}

// One table row into y (k floats); sb holds 2 * groups floats of scratch.
void dequantize_row(const Table& t, int64_t row, float* y, float* sb) {
  const int64_t groups = t.k / t.group_size;
  cpu_load_f32(t.scales, t.scale_type, row * groups, groups, sb);
  cpu_load_f32(t.biases, t.scale_type, row * groups, groups, sb + groups);
  const uint32_t* words = t.w + row * t.words;
  const int per_word = 32 / t.bits;
  const uint32_t mask = (1u << t.bits) - 1;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = sb[g], b = sb[groups + g];
    for (int64_t j = 0; j < t.group_size / per_word; ++j, ++words)
      for (int e = 0; e < per_word; ++e) *y++ = s * static_cast<float>((*words >> (t.bits * e)) & mask) + b;
  }
}

const ChainableKernel kQEmbedCpuChainable{"QEmbedCpu"};  // kernel_chain.h

class QEmbedCpu : public mx::UnaryPrimitive {
 public:
  QEmbedCpu(mx::Stream s, int group_size, int bits) : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  // in: w, scales, biases (row-contiguous, checked by qembed_cpu_applies), indices (any layout).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto& w = in[0];
    const auto& idx = in[3];
    Table t{w.data<uint32_t>(), in[1].data<void>(), in[2].data<void>(), in[1].dtype(),
            w.shape(0), w.shape(1), w.shape(1) * 32 / bits_, group_size_, bits_};
    cpu_kernel_note_call("qembed");
    encoder.dispatch([t, idx_ptr = idx.data<void>(), idx_type = idx.dtype(), shape = idx.shape(),
                      strides = idx.strides(), contiguous = idx.flags().row_contiguous, itemsize = idx.itemsize(),
                      n = static_cast<int64_t>(idx.size()), y = out.data<void>(), out_type = out.dtype()] {
      CpuRowMajor indices(idx_ptr, itemsize, shape, strides, contiguous);
      cpu_parallel_for(n, t.k, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scratch;
        const int64_t groups = t.k / t.group_size;
        float* sb = at_least(scratch, t.k + 2 * groups);
        float* row = sb + 2 * groups;
        for (int64_t r = begin; r < end; ++r) {
          int64_t i = index_at(indices.data(), idx_type, r);
          if (i < 0) i += t.rows;
          i = std::clamp<int64_t>(i, 0, t.rows - 1);
          float* dst = out_type == mx::float32 ? static_cast<float*>(y) + r * t.k : row;
          dequantize_row(t, i, dst, sb);
          if (out_type != mx::float32) cpu_store_f32(row, out_type, r * t.k, t.k, y);
        }
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("QEmbedCpu runs on the CPU only");
  }
  const char* name() const override { return "QEmbedCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QEmbedCpu&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[3].shape();
    shape.push_back(in[0].shape(1) * 32 / bits_);
    return {shape};
  }

 private:
  int group_size_, bits_;
};

bool float_type(mx::Dtype t) { return t == mx::float32 || t == mx::bfloat16 || t == mx::float16; }

bool row_major_constant(const mx::array& a) { return a.is_available() && a.flags().row_contiguous; }

}  // namespace

bool qembed_cpu_applies(const mx::array& w, const mx::array& scales, const mx::array& biases,
                        const mx::array& indices, int group_size, int bits, mx::Dtype out) {
  if (!cpu_kernels_active() || (bits != 2 && bits != 4 && bits != 8) || group_size <= 0) return false;
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) == 0 || !float_type(out)) return false;
  if (!mx::issubdtype(indices.dtype(), mx::integer)) return false;
  const int64_t k = w.shape(1) * 32 / bits;
  if (k == 0 || k % group_size != 0 || group_size % (32 / bits) != 0) return false;
  const mx::Shape grouped{w.shape(0), static_cast<int>(k / group_size)};
  for (const auto* p : {&scales, &biases})
    if (!float_type(p->dtype()) || p->dtype() != scales.dtype() || p->shape() != grouped) return false;
  return row_major_constant(w) && row_major_constant(scales) && row_major_constant(biases);
}

mx::array qembed_cpu(const mx::array& w, const mx::array& scales, const mx::array& biases, const mx::array& indices,
                     int group_size, int bits, mx::Dtype out) {
  auto shape = indices.shape();
  shape.push_back(static_cast<int>(w.shape(1) * 32 / bits));
  auto prim = std::make_shared<QEmbedCpu>(mx::default_stream(mx::Device::cpu), group_size, bits);
  return mx::array(std::move(shape), out, std::move(prim), {w, scales, biases, indices});
}

}  // namespace mlxd::rt
