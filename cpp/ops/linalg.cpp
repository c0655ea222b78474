// Matrix products.
#include "../ops_common.h"
#include "kernels/gemm_lowp_cpu.h"

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
  // transpose is a view: the kernel reads the [N, K] weight in place.
  auto y = gemm_lowp_cpu_linear_applies(x, w) ? gemm_lowp_cpu_linear(x, w) : product(x, mx::transpose(w));
  if (auto* b = ctx.maybe_in(n.bias())) y = mx::add(y, *b);
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

}  // namespace mlxd::rt
