// Fake quantization: one read and one write of the activation, split across the cores. Each step
// rounds like torch's op sequence: x * inv_scale rounded to float32, then to an integer (ties to even),
// then exact integer arithmetic, then one rounding of (q - zero_point) * scale.
#include "kernels/fake_quant_cpu.h"

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

using FakeQuantFn = void (*)(const float*, float*, int64_t, const FakeQuantParams&);

void fake_quant_portable(const float* in, float* out, int64_t n, const FakeQuantParams& p) {
  for (int64_t i = 0; i < n; ++i) {
    const float scaled = std::min(std::max(in[i], p.lo), p.hi) * p.inv_scale;  // no contraction: own statement
    const float q = std::min(std::max(std::nearbyint(scaled) + p.zero_point, p.quant_min), p.quant_max);
    out[i] = (q - p.zero_point) * p.scale;
  }
}

#ifdef MLXD_CPU_X86
struct Lanes8 {
  __m256 inv, scale, zp, lo, hi, x_lo, x_hi;
};

MLXD_AVX2 inline __m256 fake_quant8(__m256 x, const Lanes8& c) {
  x = _mm256_min_ps(_mm256_max_ps(x, c.x_lo), c.x_hi);
  __m256 q = _mm256_round_ps(_mm256_mul_ps(x, c.inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, c.zp), c.lo), c.hi);
  return _mm256_mul_ps(_mm256_sub_ps(q, c.zp), c.scale);
}

MLXD_AVX2 void fake_quant_avx2(const float* in, float* out, int64_t n, const FakeQuantParams& p) {
  const Lanes8 c{_mm256_set1_ps(p.inv_scale), _mm256_set1_ps(p.scale), _mm256_set1_ps(p.zero_point),
                 _mm256_set1_ps(p.quant_min), _mm256_set1_ps(p.quant_max), _mm256_set1_ps(p.lo),
                 _mm256_set1_ps(p.hi)};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, fake_quant8(_mm256_loadu_ps(in + i), c));
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    vmath::store_partial(out + i, fake_quant8(vmath::load_partial(in + i, rest, 0.f), c), rest);
  }
}

MLXD_AVX512 void fake_quant_avx512(const float* in, float* out, int64_t n, const FakeQuantParams& p) {
  const __m512 inv = _mm512_set1_ps(p.inv_scale), scale = _mm512_set1_ps(p.scale), zp = _mm512_set1_ps(p.zero_point);
  const __m512 lo = _mm512_set1_ps(p.quant_min), hi = _mm512_set1_ps(p.quant_max);
  const __m512 x_lo = _mm512_set1_ps(p.lo), x_hi = _mm512_set1_ps(p.hi);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vmath::first_lanes(n - i);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_maskz_loadu_ps(m, in + i), x_lo), x_hi);
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, zp), lo), hi);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_sub_ps(q, zp), scale));
  }
}
#endif

FakeQuantFn pick() {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx512()) return fake_quant_avx512;
  if (cpu_use_avx2()) return fake_quant_avx2;
#endif
  return fake_quant_portable;
}

constexpr int64_t kGrain = 4096;  // elements per task at the least: a pass this short is not worth a hand-off

class FakeQuantCpu : public mx::UnaryPrimitive {
 public:
  FakeQuantCpu(mx::Stream s, const FakeQuantParams& p) : mx::UnaryPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto& x = in[0];
    const bool contiguous = x.flags().row_contiguous;
    const bool in_place = contiguous && x.is_donatable();
    if (in_place) out.copy_shared_buffer(x);  // the input has no other reader
    auto& encoder = begin_cpu_task(stream(), in, out, in_place);
    cpu_kernel_note_call("fake_quantize");
    encoder.dispatch([f = pick(), p = p_, src = x.data<void>(), dst = out.data<float>(),
                      n = static_cast<int64_t>(x.size()), shape = x.shape(), strides = x.strides(), contiguous,
                      itemsize = x.itemsize()] {
      CpuRowMajor xs(src, itemsize, shape, strides, contiguous);
      const float* data = static_cast<const float*>(xs.data());
      cpu_parallel_for(n, 1, kGrain,
                       [&](int64_t begin, int64_t end) { f(data + begin, dst + begin, end - begin, p); });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("FakeQuantCpu runs on the CPU only");
  }
  const char* name() const override { return "FakeQuantCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FakeQuantCpu&>(other).p_;
    return p_.inv_scale == o.inv_scale && p_.scale == o.scale && p_.zero_point == o.zero_point &&
           p_.quant_min == o.quant_min && p_.quant_max == o.quant_max && p_.lo == o.lo && p_.hi == o.hi;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }

 private:
  FakeQuantParams p_;
};

}  // namespace

bool fake_quant_cpu_applies(const mx::array& x) {
  return cpu_kernels_active() && x.dtype() == mx::float32 && x.size() > 0;
}

mx::array fake_quant_cpu(const mx::array& x, const FakeQuantParams& p) {
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<FakeQuantCpu>(stream, p), {x});
}

mx::array fake_quant_mlx(const mx::array& x, const FakeQuantParams& p) {
  auto f = [](float v) { return mx::array(v, mx::float32); };
  auto clamped = mx::minimum(mx::maximum(x, f(p.lo)), f(p.hi));
  auto q = mx::clip(mx::add(mx::round(mx::multiply(clamped, f(p.inv_scale))), f(p.zero_point)), f(p.quant_min),
                    f(p.quant_max));
  return mx::multiply(mx::subtract(q, f(p.zero_point)), f(p.scale));
}

}  // namespace mlxd::rt
