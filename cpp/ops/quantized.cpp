// Weight-only quantized products in MLX's affine format: packed unsigned
// weights (stored as int32 words, viewed as uint32 here) with per-group scales
// and biases, w = scales * q + biases along the last axis.
#include "../ops_common.h"
#include "kernels/fake_quant_cpu.h"
#include "kernels/qembed_cpu.h"
#include "kernels/qgemm_cpu.h"
#include "kernels/qgemv_cpu.h"

#include <array>
#include <string>

namespace mlxd::rt {
namespace {

// The CPU runs our own kernels (kernels/qgemm_cpu.h: prefill-sized products
// as dequantized chunks on the BLAS; kernels/qgemv_cpu.h: the rest, any number
// of rows with AVX2, decode-sized products otherwise) unless MLX_DELEGATE_CPU_KERNELS=0
// turns it off. Otherwise a few rows run MLX's CPU quantized matmul, a plain
// loop, in fp32 (it is much slower in bf16/fp16); from this many rows on
// dequantize + the BLAS matmul is several times faster. GPUs always run
// quantized_matmul.
constexpr int64_t kCpuDequantizeRows = 8;

// The payload stores the packed words as int32 (torch has no usable uint32);
// MLX's quantized kernels read them as uint32. A view, not a copy: of a constant, made
// once per loaded program (a view per call is a graph node per product and call).
constexpr int kPackedWordsKey = 32;  // derived_constant's key (per slot)
mx::array packed_words(ExecContext& ctx, const mlxd::Tid* tid) {
  const auto& w = ctx.in(tid);
  if (w.dtype() != mx::int32 && w.dtype() != mx::uint32) throw NodeError("packed weights must be 32-bit words");
  if (w.ndim() != 2) throw NodeError("packed weights must be 2-D");
  if (w.dtype() == mx::uint32) return w;
  auto view = [](const mx::array& a) { return mx::view(a, mx::uint32); };
  return ctx.derived_constant(tid, kPackedWordsKey, view).value_or(view(w));
}

// Scales and biases may be stored in a dtype other than x's (GGUF's fp16 d and m under fp32
// activations): our CPU kernels read them as stored; MLX's kernels get a copy in the dtype they
// compute in, converted once per loaded program (ExecContext::in_as), not per call.
// `fused` is set when the GEMV applied the node's GLU and residual itself (no bias: it comes first).
mx::array cpu_product(ExecContext& ctx, const mlxd::QuantizedLinearNode& n, const mx::array& x, const mx::array& w,
                      bool& fused) {
  const int group_size = n.group_size(), bits = n.bits();
  fused = false;
  if (qgemm_cpu_applies(x, group_size, bits))
    return mx::astype(qgemm_cpu(x, w, ctx.in(n.scales()), ctx.in(n.biases()), group_size, bits), x.dtype());
  if (qgemv_cpu_applies(x, group_size, bits)) {
    QgemvEpilogue epilogue;
    if (auto* nw = ctx.maybe_in(n.norm_weight())) {
      epilogue.norm_weight = *nw;
      epilogue.norm_eps = n.norm_eps();
    }
    if (!n.bias()) {
      fused = true;
      epilogue.glu = n.glu();
      if (auto* r = ctx.maybe_in(n.residual())) epilogue.residual = *r;
    }
    return mx::astype(qgemv_cpu(x, w, ctx.in(n.scales()), ctx.in(n.biases()), group_size, bits, epilogue), x.dtype());
  }
  auto scales = ctx.in_as(n.scales(), mx::float32), biases = ctx.in_as(n.biases(), mx::float32);
  auto xf = mx::astype(x, mx::float32);
  int64_t k = x.ndim() ? x.shape(-1) : 0;
  int64_t rows = k ? static_cast<int64_t>(x.size()) / k : 0;
  auto y = rows >= kCpuDequantizeRows
               ? mx::matmul(xf, mx::transpose(mx::dequantize(w, scales, biases, group_size, bits, "affine")))
               : mx::quantized_matmul(xf, w, scales, biases, true, group_size, bits, "affine");
  return mx::astype(y, x.dtype());
}

// MLX's names for the schema's quantization modes.
constexpr std::array<OpRow<mlxd::QuantMode, const char*>, enum_size<mlxd::QuantMode>()> kModes = {{
    {mlxd::QuantMode::Affine, "affine"},
    {mlxd::QuantMode::Mxfp4, "mxfp4"},
    {mlxd::QuantMode::Nvfp4, "nvfp4"},
    {mlxd::QuantMode::Mxfp8, "mxfp8"},
}};
static_assert(rows_follow_enum(kModes), "kModes: one row per QuantMode, in the schema's order");

std::string mode_name(mlxd::QuantMode m) { return table_at(kModes, m, "quantization mode"); }

// The microscaling modes: uint8 scales, no biases. MLX's CPU quantized matmul for them is a
// plain loop, so from kCpuDequantizeRows rows the CPU dequantizes and runs the BLAS matmul.
mx::array microscaled_product(const mx::array& x, const mx::array& w, const mx::array& scales, int group_size,
                              int bits, const std::string& mode) {
  if (scales.dtype() != mx::uint8) throw NodeError(mode + " scales must be uint8");
  if (mx::default_device() != mx::Device::cpu)
    return mx::quantized_matmul(x, w, scales, std::nullopt, true, group_size, bits, mode);
  auto xf = mx::astype(x, mx::float32);
  int64_t k = x.ndim() ? x.shape(-1) : 0;
  int64_t rows = k ? static_cast<int64_t>(x.size()) / k : 0;
  auto y = rows >= kCpuDequantizeRows
               ? mx::matmul(xf, mx::transpose(mx::dequantize(w, scales, std::nullopt, group_size, bits, mode,
                                                             std::nullopt, mx::float32)))
               : mx::quantized_matmul(xf, w, scales, std::nullopt, true, group_size, bits, mode);
  return mx::astype(y, x.dtype());
}

// The node's GLU and residual as MLX ops, where the product did not apply them.
mx::array epilogue(ExecContext& ctx, const mlxd::QuantizedLinearNode& n, mx::array y) {
  if (n.glu()) {
    const int h = y.shape(-1) / 2;
    if (y.shape(-1) != 2 * h) throw NodeError("a GLU needs an even number of outputs");
    auto parts = mx::split(y, 2, -1);
    // SiLU as the unary node runs it (the CPU kernel where it applies): MLX's CPU sigmoid is a scalar
    // single-core loop, which cost a 64-token SmolLM2 prefill a third of its speed (660 -> 430 tok/s).
    y = mx::multiply(unary_op(mlxd::UnaryOp::Silu, parts[0]), parts[1]);
  }
  if (auto* r = ctx.maybe_in(n.residual())) y = mx::add(y, *r);
  return y;
}

}  // namespace

void exec_QuantizedLinearNode(const mlxd::QuantizedLinearNode& n, ExecContext& ctx) {
  auto x = ctx.in(n.x());
  auto w = packed_words(ctx, n.w());
  // The norm before the product: in the GEMV's call where it runs (cpu_product), as an op otherwise.
  const bool gemv = mx::default_device() == mx::Device::cpu && n.mode() == mlxd::QuantMode::Affine &&
                    !qgemm_cpu_applies(x, n.group_size(), n.bits()) &&
                    qgemv_cpu_applies(x, n.group_size(), n.bits());
  if (auto* nw = ctx.maybe_in(n.norm_weight()); nw && !gemv) x = rms_norm_last(x, *nw, n.norm_eps());
  if (n.mode() != mlxd::QuantMode::Affine) {
    auto y = microscaled_product(x, w, ctx.in(n.scales()), n.group_size(), n.bits(), mode_name(n.mode()));
    if (auto* b = ctx.maybe_in(n.bias())) y = mx::add(y, *b);
    ctx.set(n.out(), epilogue(ctx, n, y));
    return;
  }
  bool fused = false;
  auto y = mx::default_device() == mx::Device::cpu
               ? cpu_product(ctx, n, x, w, fused)
               : mx::quantized_matmul(x, w, ctx.in_as(n.scales(), x.dtype()), ctx.in_as(n.biases(), x.dtype()),
                                      /*transpose=*/true, n.group_size(), n.bits(), "affine");
  if (fused) {
    ctx.set(n.out(), y);
    return;
  }
  if (auto* b = ctx.maybe_in(n.bias())) y = mx::add(y, *b);
  ctx.set(n.out(), epilogue(ctx, n, y));
}

// The rows the indices pick, dequantized: on the CPU one kernel (kernels/qembed_cpu.h); otherwise the
// packed rows with their scales and biases are gathered, and only those dequantized (in float32 for
// float32_out, as the wider type: exact for fp16 / bf16 scales).
void exec_QuantizedEmbeddingNode(const mlxd::QuantizedEmbeddingNode& n, ExecContext& ctx) {
  const auto& idx = ctx.in(n.indices());
  const auto& scales = ctx.in(n.scales());
  const auto& biases = ctx.in(n.biases());
  auto w = packed_words(ctx, n.w());
  const auto dtype = n.float32_out() ? mx::float32 : scales.dtype();
  // torch's embedding rejects such an index; MLX's take would read a clamped row without a word.
  ctx.guard_index(n.indices(), 0, w.shape(0) - 1, "embedding index");
  if (qembed_cpu_applies(w, scales, biases, idx, n.group_size(), n.bits(), dtype)) {
    ctx.set(n.out(), qembed_cpu(w, scales, biases, idx, n.group_size(), n.bits(), dtype));
    return;
  }
  auto flat = mx::flatten(idx);
  auto rows = [&](const mx::array& a) { return mx::take(a, flat, 0); };
  auto widened = [&](const mx::array& a) { return a.dtype() == dtype ? a : mx::astype(a, dtype); };
  auto y = mx::dequantize(rows(w), widened(rows(scales)), widened(rows(biases)), n.group_size(), n.bits(), "affine",
                          std::nullopt, dtype);
  auto shape = idx.shape();
  shape.push_back(y.shape(-1));
  ctx.set(n.out(), mx::reshape(y, shape));
}

// A whole packed weight (or gathered rows of one) back to floating point; biases only for affine.
// MLX's affine dequantize computes in the scales' dtype, so it runs in the wider of the scales'
// dtype and `dtype` (fp16 scales under fp32: exact) and casts after; a constant's widened scales
// are converted once per program. The microscaled modes decode in float32 and then cast: asked for
// bf16 directly, MLX 0.32's CPU compile fuses float32 and bf16 operands into one kernel that the
// C++ compiler rejects.
void exec_DequantizeNode(const mlxd::DequantizeNode& n, ExecContext& ctx) {
  const auto dtype = to_mlx(n.dtype());
  auto w = packed_words(ctx, n.w());
  mx::array y = w;
  if (n.mode() == mlxd::QuantMode::Affine) {
    if (!n.biases()) throw NodeError("affine dequantize needs biases");
    const auto compute = mx::promote_types(ctx.in(n.scales()).dtype(), dtype);
    y = mx::dequantize(w, ctx.in_as(n.scales(), compute), ctx.in_as(n.biases(), compute), n.group_size(), n.bits(),
                       "affine", std::nullopt, compute);
  } else {
    std::optional<mx::array> biases;
    if (auto* b = ctx.maybe_in(n.biases())) biases = *b;
    y = mx::dequantize(w, ctx.in(n.scales()), biases, n.group_size(), n.bits(), mode_name(n.mode()), std::nullopt,
                       mx::float32);
  }
  ctx.set(n.out(), y.dtype() == dtype ? y : mx::astype(y, dtype));
}

void exec_FakeQuantizeNode(const mlxd::FakeQuantizeNode& n, ExecContext& ctx) {
  const mx::array& x = ctx.in(n.x());
  const FakeQuantParams p{n.inv_scale(), n.scale(), n.zero_point(), n.quant_min(), n.quant_max(), n.lo(), n.hi()};
  ctx.set(n.out(), fake_quant_cpu_applies(x) ? fake_quant_cpu(x, p) : fake_quant_mlx(x, p));
}

}  // namespace mlxd::rt
