// The BLAS shim's serial sgemm and its weight packs (blas_shim.cpp), resolved with dlsym so that the
// kernels run without the shim too; see cpu_parallel.h.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {

SerialSgemmFn serial_sgemm() {
  static const SerialSgemmFn f = [] {
    auto ready = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_ready"));
    auto fn = reinterpret_cast<SerialSgemmFn>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_serial"));
    return ready && fn && ready() == 1 ? fn : nullptr;
  }();
  return f;
}

SerialSgemmBSourceFn serial_sgemm_b_source() {
  static const SerialSgemmBSourceFn f = [] {
    if (serial_sgemm() == nullptr) return SerialSgemmBSourceFn{nullptr};
    auto fn = reinterpret_cast<SerialSgemmBSourceFn>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_serial_b_source"));
    // m 0 asks whether an own tile serves (nothing is read or written).
    return fn && fn(0, 0, 0, 1.f, nullptr, 1, nullptr, nullptr, 0.f, nullptr, 1) == 1 ? fn : nullptr;
  }();
  return f;
}

namespace {

// The shim's packing entry points (blas_shim.cpp), resolved once; null without the shim.
struct PackFns {
  int64_t (*floats)(int, int) = nullptr;
  int (*pack)(int, int, int, int, int, const float*, int, float*) = nullptr;
  int (*align)(const float*) = nullptr;
  int (*scaled)(const float*, int, int, const float*, float*) = nullptr;
  int (*packed)(const float*, int, int, int, int, int, float, const float*, int, float, float*, int) = nullptr;
  int (*packed_ct)(const float*, int, int, int, int, int, float, const float*, int, float, float*, int) = nullptr;
};

const PackFns& pack_fns() {
  static const PackFns f = [] {
    PackFns p;
    if (serial_sgemm() == nullptr) return p;
    p.floats = reinterpret_cast<decltype(p.floats)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_pack_a_floats"));
    p.pack = reinterpret_cast<decltype(p.pack)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_pack_a"));
    p.align = reinterpret_cast<decltype(p.align)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_pack_align"));
    p.scaled = reinterpret_cast<decltype(p.scaled)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_pack_a_scaled"));
    p.packed = reinterpret_cast<decltype(p.packed)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_serial_packed"));
    p.packed_ct = reinterpret_cast<decltype(p.packed_ct)>(dlsym(RTLD_DEFAULT, "mlxd_sgemm_serial_packed_ct"));
    if (!p.floats || !p.pack || !p.align || !p.scaled || !p.packed || !p.packed_ct) p = {};
    return p;
  }();
  return f;
}

}  // namespace

std::optional<mlx::core::array> serial_sgemm_pack(const float* a, int count, int m, int k, SgemmPackHints hints) {
  // Read at each pack (a program's first call): A/B runs load one program with packs and one without.
  const char* off = std::getenv("MLX_DELEGATE_WEIGHT_PACKS");
  if (off && std::strcmp(off, "0") == 0) return std::nullopt;
  const PackFns& f = pack_fns();
  const int64_t per = f.floats ? f.floats(m, k) : 0;
  if (per <= 0 || count <= 0) return std::nullopt;
  std::vector<float> packed(static_cast<size_t>(count * per));
  for (int i = 0; i < count; ++i)
    if (f.pack(m, k, hints.m, hints.n, hints.across, a + int64_t{i} * m * k, k, packed.data() + i * per) == 0)
      return std::nullopt;
  return mlx::core::array(packed.begin(), mlx::core::Shape{count, static_cast<int>(per)}, mlx::core::float32);
}

const float* serial_sgemm_pack_at(const mlx::core::array& pack, int index) {
  return pack.data<float>() + int64_t{index} * pack.shape(1);
}

bool serial_sgemm_packed(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                         int ldb, float beta, float* c, int ldc) {
  const PackFns& f = pack_fns();
  return pack && f.packed && f.packed(pack, r0, m, k, trans_b, n, alpha, b, ldb, beta, c, ldc) == 1;
}

bool serial_sgemm_packed_ct(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                            int ldb, float beta, float* ct, int ldct) {
  const PackFns& f = pack_fns();
  return pack && f.packed_ct && f.packed_ct(pack, r0, m, k, trans_b, n, alpha, b, ldb, beta, ct, ldct) == 1;
}

const float* serial_sgemm_pack_scaled(const float* pack, int r0, int m, int k, const float* kscale,
                                      std::vector<float>& buffer) {
  const PackFns& f = pack_fns();
  if (!pack || !f.scaled) return nullptr;
  const int64_t floats = f.floats(m, k);
  if (floats <= 0) return nullptr;
  if (buffer.size() < static_cast<size_t>(floats + 16)) buffer.resize(static_cast<size_t>(floats + 16));
  // On a 64-byte boundary, as the panels of a constant's pack are.
  const auto at = (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63};
  float* dst = reinterpret_cast<float*>(at);
  return f.scaled(pack, r0, m, kscale, dst) == 1 ? dst : nullptr;
}

int serial_sgemm_pack_align(const float* pack) {
  const PackFns& f = pack_fns();
  return pack && f.align ? f.align(pack) : 1;
}

}  // namespace mlxd::rt
