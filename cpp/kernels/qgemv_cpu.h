// A CPU kernel for weight-only quantized products:
// y[M, N] = x[M, K] . dequantize(w)^T in MLX's affine layout, as an MLX
// primitive so it runs on the CPU stream like any other op. MLX's own CPU
// quantized_matmul is a single-threaded scalar loop; this one is vectorised
// (integer dot products with AVX-512 VNNI or AVX2, whichever the CPU has) and
// splits N across the cores. Rows of x are taken kQgemvMaxRows at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/mlx.h>
#include <mlx/primitives.h>

namespace mlxd::rt {

// Whether qgemv_cpu takes this product: cpu_kernels_active() (kernels/cpu_parallel.h:
// MLX_DELEGATE_CPU_KERNELS=0 or set_cpu_kernels(False) turn it off, =portable forces the
// non-AVX2 code), bits 4 or 8, a group size that is a multiple of 32 dividing K; any number
// of rows with AVX2, at most kQgemvMaxRows for the portable loop.
constexpr int64_t kQgemvMaxRows = 8;
bool qgemv_cpu_applies(const mlx::core::array& x, int group_size, int bits);

// Shared by the quantized CPU kernels (qgemv_cpu, qgemm_cpu): whether x's last axis, the group size and
// the bit width are a layout they take, and the operands' checks (std::invalid_argument naming `who`).
bool quantized_layout_ok(const mlx::core::array& x, int group_size, int bits);
void check_quantized_operands(const char* who, const mlx::core::array& x, const mlx::core::array& w,
                              const mlx::core::array& scales, const mlx::core::array& biases, int group_size, int bits);

// The MLX-primitive parts both quantized CPU kernels share: y [..., N] from x [..., K] and w [N, ...],
// CPU only, equivalent (for MLX's compile) when the kernel, group size and bit width are.
class QuantizedProductCpu : public mlx::core::UnaryPrimitive {
 public:
  QuantizedProductCpu(mlx::core::Stream s, const char* name, int group_size, int bits)
      : mlx::core::UnaryPrimitive(s), name_(name), group_size_(group_size), bits_(bits) {}
  void eval_gpu(const std::vector<mlx::core::array>&, mlx::core::array&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedProductCpu&>(other);
    return name_ == o.name_ && group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mlx::core::Shape> output_shapes(const std::vector<mlx::core::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 protected:
  const char* name_;
  int group_size_, bits_;
};

// What the GEMV applies to its product before writing it, in the same call (a decode step then
// runs one primitive where it ran three): `glu` takes the product's two halves along N as a gate
// and its up projection and returns silu(gate) * up ([..., N / 2]); `residual` ([..., N or N / 2],
// a float dtype) is added last.
struct QgemvEpilogue {
  bool glu = false;
  std::optional<mlx::core::array> residual;
  // And before it: x RMS-normalised over its last axis and scaled by `norm_weight` ([K]).
  std::optional<mlx::core::array> norm_weight;
  float norm_eps = 0.f;
};

// x [..., K] float32, w [N, K * bits / 32] uint32, scales and biases [N, K / group_size]
// float32; returns [..., N] float32 ([..., N / 2] with a GLU epilogue).
mlx::core::array qgemv_cpu(const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
                           const mlx::core::array& biases, int group_size, int bits,
                           const QgemvEpilogue& epilogue = {});

// How many times the kernel has run (eval_cpu calls): tests use it to prove it ran.
uint64_t qgemv_cpu_calls();

// The one-row path for groups of 32 (on by default): off runs those products on the general
// per-group loop, for parity tests and A/B timings in one process.
void qgemv_cpu_set_group32_path(bool on);

// The AVX-512 VNNI kernels (on by default where the CPU has AVX-512 BW, VL and VNNI and
// MLX_DELEGATE_CPU_KERNELS is not "avx2"): off runs the AVX2 kernels, for parity tests and A/B timings.
void qgemv_cpu_set_avx512_path(bool on);

// How a decode-sized product (x with at most kQgemvMaxRows rows) splits its N rows across the
// pool: on (opt-in: MLX_DELEGATE_QGEMV_GUIDED=1 at start-up), pieces claimed from one counter that
// shrink as the product ends; off (default), four equal parts per thread. For A/B timings and
// parity tests in one process.
void qgemv_cpu_set_guided_split(bool on);
bool qgemv_cpu_guided_split();

// Weight rows per step of the AVX-512 one-row kernels: 1, 2 or 4 (4 by default on Intel processors, 1
// elsewhere; MLX_DELEGATE_QGEMV_ROWS at start-up), from the next call on. Returns the previous value (1
// where the kernels are not built). For A/B timings and parity tests in one process.
int qgemv_cpu_set_one_row_block(int rows);

// Per-step counters of the GEMV's calls, kept while the pool's stats are on (cpu_pool_set_stats;
// benchmarks/decode_split.py): where a decode step's time goes between and inside its products.
// Times are wall (steady clock) and the running thread's CPU time (CLOCK_THREAD_CPUTIME_ID); a gap is
// the time on MLX's stream thread from one product's end to the next one's start (the other nodes and
// MLX's scheduling), counted only after qgemv_cpu_reset_stats / qgemv_cpu_step_begin.
struct QgemvStats {
  uint64_t calls = 0;
  uint64_t wall_ns = 0, cpu_ns = 0;  // the whole task: preparation, the parallel product, epilogue
  uint64_t parallel_ns = 0;          // the product's rows on the pool (the streaming part)
  uint64_t bytes = 0;                // weights, scales and biases read
  uint64_t gaps = 0, gap_wall_ns = 0, gap_cpu_ns = 0;
  // Between qgemv_cpu_step_begin and the step's first product, and between its last product and
  // qgemv_cpu_step_end (the call's set-up and graph enqueue before; the output after).
  uint64_t lead_ns = 0, tail_ns = 0;
};
QgemvStats qgemv_cpu_stats();
void qgemv_cpu_reset_stats();
// Starts a new step: the next call's gap is not counted (it would span the time between steps).
void qgemv_cpu_step_begin();
// Ends a step (after its call returned): the time since its last product counts as its tail.
void qgemv_cpu_step_end();

}  // namespace mlxd::rt
