// Matrix products.
#include "../ops_common.h"
#include "mlx/backend/cuda/cuda.h"
#include "kernels/gemm_lowp_cpu.h"
#include "kernels/linear_cpu.h"

namespace mlxd::rt {

// a @ b with torch.matmul's semantics. bf16/fp16 products on the CPU run our
// kernel (kernels/gemm_lowp_cpu.h): MLX's own is a scalar loop for them; so do
// float32 products of <= 8 rows by a transposed weight (decode linears: MKL's
// sgemm is far from memory bandwidth there).
static mx::array product(const mx::array& a, const mx::array& b) {
  return gemm_lowp_cpu_applies(a, b) ? gemm_lowp_cpu(a, b) : mx::matmul(a, b);
}

void exec_MatmulNode(const mlxd::MatmulNode& n, ExecContext& ctx) {
  ctx.set(n.out(), product(ctx.in(n.a()), ctx.in(n.b())));
}

void exec_LinearNode(const mlxd::LinearNode& n, ExecContext& ctx) {
  const auto& w = ctx.in(n.weight());
  if (w.ndim() != 2) throw NodeError("linear weight must be 2-D");
  const auto& x = ctx.in(n.x());
  const auto* b = ctx.maybe_in(n.bias());
  const auto bias = b ? std::optional<mx::array>(*b) : std::nullopt;
  const auto* r = ctx.maybe_in(n.residual());
  std::optional<mx::array> residual;
  if (r) {
    if (n.act()) throw NodeError("linear: a residual with a fused activation is not supported");
    auto shape = x.shape();
    if (shape.empty()) throw NodeError("linear input must have at least one axis");
    shape.back() = w.shape(0);
    if (r->shape() != shape || r->dtype() != x.dtype())
      throw NodeError("linear residual must have the output's shape and dtype");
    residual = *r;
  }
  // fp32 on the CPU: the bias, residual and a fused activation applied to each output block in cache
  // (kernels/linear_cpu.h), inside the product's parallel parts.
  const auto act = n.act() ? cpu_kernel_for(n.act_op()) : std::nullopt;
  if ((!n.act() || act) && linear_cpu_applies(x, w, bias, residual))
    return ctx.set(n.out(), linear_cpu(x, w, bias, residual, act));
  // transpose is a view: the kernel reads the [N, K] weight in place.
  auto y = gemm_lowp_cpu_linear_applies(x, w) ? gemm_lowp_cpu_linear(x, w) : product(x, mx::transpose(w));
  // A fused activation takes the bias along: one pass over the product (in place on the CPU).
  if (n.act()) return ctx.set(n.out(), unary_op(n.act_op(), y, bias));
  if (b) y = mx::add(y, *b);
  if (r) y = mx::add(y, *r);
  ctx.set(n.out(), y);
}

void exec_AddmmNode(const mlxd::AddmmNode& n, ExecContext& ctx) {
  const auto &a = ctx.in(n.a()), &b = ctx.in(n.b()), &c = ctx.in(n.c());
  auto scaled = [&](mx::array y, double factor) {
    return factor == 1 ? y : mx::multiply(y, mx::array(factor, y.dtype()));
  };
  if (n.beta() == 0) {  // torch ignores c entirely then (NaN/inf in c must not leak through 0 * c)
    auto y = scaled(product(a, b), n.alpha());
    ctx.set(n.out(), mx::broadcast_to(y, mx::broadcast_shapes(y.shape(), c.shape())));
  } else if (gemm_lowp_cpu_applies(a, b)) {
    ctx.set(n.out(), mx::add(scaled(c, n.beta()), scaled(gemm_lowp_cpu(a, b), n.alpha())));
  } else {
    ctx.set(n.out(), mx::addmm(c, a, b, static_cast<float>(n.alpha()), static_cast<float>(n.beta())));
  }
}

void exec_GroupedMatmulNode(const mlxd::GroupedMatmulNode& n, ExecContext& ctx) {
  const auto &x = ctx.in(n.x()), &w = ctx.in(n.weight()), &offs = ctx.in(n.offsets());
  if (x.ndim() != 2 || w.ndim() != 3 || offs.ndim() != 1 || offs.shape(0) != w.shape(0) || x.shape(1) != w.shape(1))
    throw NodeError("grouped matmul needs x [S, K], weight [G, K, N] and offsets [G]");
  int rows = x.shape(0), groups = w.shape(0);
  // Row i belongs to the first group whose cumulative end exceeds i.
  auto ends = mx::astype(offs, mx::int32);
  auto row = mx::expand_dims(mx::arange(rows, mx::int32), 1);
  auto group = mx::sum(mx::astype(mx::greater_equal(row, mx::expand_dims(ends, 0)), mx::uint32), 1);
  auto owned = mx::less(group, mx::array(static_cast<uint32_t>(groups)));
  group = mx::minimum(group, mx::array(static_cast<uint32_t>(groups - 1)));
  // gather_mm: one [1, K] x [K, N] product per row, the rows already sorted by group.
  // MLX's CPU gather_mm is float32 only: other types go through float32 there.
  bool widen = x.dtype() != mx::float32 && mx::default_device() == mx::Device::cpu;
  auto lhs = widen ? mx::astype(x, mx::float32) : x, rhs = widen ? mx::astype(w, mx::float32) : w;
  // [S, 1, K] by reshape, not expand_dims: MLX gives an inserted axis stride 1, and its sorted gather_mm
  // on CUDA (on Metal before 0.32.1) takes the row stride from that axis: wrong rows, measured on an H100.
  // CUDA runs the unsorted form (measured correct there) until a GPU run checks the sorted one on these rows.
  bool sorted = !(mx::default_device() == mx::Device::gpu && mx::cu::is_available());
  auto y = mx::gather_mm(mx::reshape(lhs, {rows, 1, x.shape(1)}), rhs, std::nullopt, group, sorted);
  y = mx::reshape(y, {rows, y.shape(-1)});
  if (widen) y = mx::astype(y, x.dtype());
  ctx.set(n.out(), mx::where(mx::expand_dims(owned, 1), y, mx::zeros_like(y)));
}

}  // namespace mlxd::rt
