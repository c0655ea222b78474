// Element-wise maps on the CPU: the array is cut into chunks (converted to
// float32 on the way in and out for half types), and the chunks split into
// one contiguous range per core.
#include "kernels/unary_cpu.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

using MapFn = UnaryMapFn;

// ---- Portable: libm, one element at a time ----------------------------------

float silu1(float x) { return x / (1.f + std::exp(-x)); }
float sigmoid1(float x) { return 1.f / (1.f + std::exp(-x)); }
float gelu_erf1(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f)); }
float gelu_tanh1(float x) { return 0.5f * x * (1.f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x))); }
float exp1(float x) { return std::exp(x); }
float erf1(float x) { return std::erf(x); }
float relu6_shift1(float x) { return std::min(std::max(x + 3.f, 0.f), 6.f); }
float hardswish1(float x) { return x * relu6_shift1(x) / 6.f; }
float hardsigmoid1(float x) { return relu6_shift1(x) / 6.f; }

template <float (*F)(float)>
void map_portable(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F(in[i]);
}

// ---- AVX2 + FMA: eight lanes, a masked tail ----------------------------------

#ifdef MLXD_CPU_X86
template <__m256 (*F)(__m256)>
MLXD_AVX2 void map_avx2(const float* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, F(_mm256_loadu_ps(in + i)));
  if (i < n) vmath::store_partial(out + i, F(vmath::load_partial(in + i, static_cast<int>(n - i), 0.f)), static_cast<int>(n - i));
}

// ---- AVX-512F: sixteen lanes, a masked tail ----------------------------------
template <__m512 (*F)(__m512)>
MLXD_AVX512 void map_avx512(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vmath::first_lanes(n - i);
    _mm512_mask_storeu_ps(out + i, m, F(_mm512_maskz_loadu_ps(m, in + i)));
  }
}
#endif

struct KernelInfo {
  const char* name;
  MapFn portable;
  MapFn avx2;
  MapFn avx512;
};

// Rows follow `enum class UnaryKernel`.
#ifdef MLXD_CPU_X86
#define MLXD_MAP(name, scalar, vec) {name, map_portable<scalar>, map_avx2<vmath::vec##8>, map_avx512<vmath::vec##16>}
#else
#define MLXD_MAP(name, scalar, vec) {name, map_portable<scalar>, nullptr, nullptr}
#endif
const KernelInfo kKernels[] = {
    MLXD_MAP("exp", exp1, exp),
    MLXD_MAP("sigmoid", sigmoid1, sigmoid),
    MLXD_MAP("silu", silu1, silu),
    MLXD_MAP("gelu_erf", gelu_erf1, gelu_erf),
    MLXD_MAP("gelu_tanh", gelu_tanh1, gelu_tanh),
    MLXD_MAP("erf", erf1, erf),
    MLXD_MAP("hardswish", hardswish1, hardswish),
    MLXD_MAP("hardsigmoid", hardsigmoid1, hardsigmoid),
};
#undef MLXD_MAP

const KernelInfo& info(UnaryKernel k) { return kKernels[static_cast<int>(k)]; }

MapFn pick(UnaryKernel k) {
  if (cpu_use_avx512() && info(k).avx512) return info(k).avx512;
  return cpu_use_avx2() && info(k).avx2 ? info(k).avx2 : info(k).portable;
}

// Half types go through a float32 buffer this long (on the stack).
constexpr int64_t kChunk = 2048;

void run_map(MapFn f, const void* in, void* out, mx::Dtype dtype, int64_t n) {
  cpu_parallel_for(n, 1, kChunk, [&](int64_t begin, int64_t end) {
    if (dtype == mx::float32) {
      f(static_cast<const float*>(in) + begin, static_cast<float*>(out) + begin, end - begin);
      return;
    }
    float buf[kChunk];
    for (int64_t i = begin; i < end; i += kChunk) {
      int64_t len = std::min(kChunk, end - i);
      cpu_load_f32(in, dtype, i, len, buf);
      f(buf, buf, len);
      cpu_store_f32(buf, dtype, i, len, out);
    }
  });
}

// f(x + bias) over rows of `cols` elements: per row and chunk, widen to
// float32 on the stack, add the bias (widened once), map, store.
void run_map_bias(MapFn f, const void* in, void* out, mx::Dtype dtype, int64_t n, const void* bias,
                  mx::Dtype bias_dtype, int64_t bias_stride, int64_t cols) {
  std::vector<float> b(cols);
  for (int64_t j = 0; j < cols; ++j) cpu_load_f32(bias, bias_dtype, j * bias_stride, 1, b.data() + j);
  cpu_parallel_for(n / cols, cols, 1, [&](int64_t begin, int64_t end) {
    float buf[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; c += kChunk) {
        const int64_t len = std::min(kChunk, cols - c), at = r * cols + c;
        cpu_load_f32(in, dtype, at, len, buf);
        const float* bc = b.data() + c;
        for (int64_t i = 0; i < len; ++i) buf[i] += bc[i];
        f(buf, buf, len);
        cpu_store_f32(buf, dtype, at, len, out);
      }
    }
  });
}

const ChainableKernel kUnaryCpuChainable{"UnaryCpu"};  // kernel_chain.h

class UnaryCpu : public mx::UnaryPrimitive {
 public:
  UnaryCpu(mx::Stream s, UnaryKernel kind) : mx::UnaryPrimitive(s), kind_(kind) {}

  // in[0]: any layout, same dtype and shape as out; in[1] (optional): the
  // bias, 1-D along the last axis, any stride.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto& x = in[0];
    const bool contiguous = x.flags().row_contiguous;
    const bool in_place = contiguous && x.is_donatable() && x.itemsize() == out.itemsize();
    if (in_place) out.copy_shared_buffer(x);  // the input has no other reader
    auto& encoder = begin_cpu_task(stream(), in, out, in_place);
    if (in.size() > 1) {
      const auto& bias = in[1];
      cpu_kernel_note_call("bias_act");
      encoder.dispatch([f = pick(kind_), src = x.data<void>(), dst = out.data<void>(), dtype = x.dtype(),
                        n = static_cast<int64_t>(x.size()), shape = x.shape(), strides = x.strides(), contiguous,
                        itemsize = x.itemsize(), b = bias.data<void>(), bias_dtype = bias.dtype(),
                        bias_stride = static_cast<int64_t>(bias.strides()[0]), cols = static_cast<int64_t>(bias.size())] {
        CpuRowMajor xs(src, itemsize, shape, strides, contiguous);
        run_map_bias(f, xs.data(), dst, dtype, n, b, bias_dtype, bias_stride, cols);
      });
      return;
    }
    cpu_kernel_note_call(info(kind_).name);
    encoder.dispatch([f = pick(kind_), src = x.data<void>(), dst = out.data<void>(), dtype = x.dtype(),
                      n = static_cast<int64_t>(x.size()), shape = x.shape(), strides = x.strides(), contiguous,
                      itemsize = x.itemsize()] {
      CpuRowMajor xs(src, itemsize, shape, strides, contiguous);
      run_map(f, xs.data(), dst, dtype, n);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("UnaryCpu runs on the CPU only");
  }
  const char* name() const override { return "UnaryCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const UnaryCpu&>(other).kind_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }

 private:
  UnaryKernel kind_;
};

}  // namespace

UnaryMapFn unary_cpu_map(UnaryKernel kind) { return pick(kind); }

bool unary_cpu_applies(const mx::array& x, const std::optional<mx::array>& bias) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x)) return false;
  return !bias || (bias->ndim() == 1 && x.ndim() >= 1 && bias->shape(0) == x.shape(-1) && cpu_kernel_dtype_ok(*bias));
}

mx::array unary_cpu(const mx::array& x, UnaryKernel kind, const std::optional<mx::array>& bias) {
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  if (bias) inputs.push_back(*bias);
  return mx::array(x.shape(), x.dtype(), std::make_shared<UnaryCpu>(stream, kind), std::move(inputs));
}

}  // namespace mlxd::rt
