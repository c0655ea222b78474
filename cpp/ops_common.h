// Helpers shared by the exec_<Node> functions in cpp/ops/. No op bodies here.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>

#include "ops_generated.h"
#include "runtime.h"

namespace mlxd::rt {

// Op tables are keyed by the schema's enums: each row names the value it
// serves, and `static_assert(rows_follow_enum(table))` fails the build when a
// row is missing, extra or out of the schema's order.
template <typename Enum, typename Fn>
struct OpRow {
  Enum op;
  Fn fn;
};

template <typename Enum>
constexpr std::size_t enum_size() {
  return static_cast<std::size_t>(Enum::MAX) + 1;
}

template <typename Enum, typename Fn, std::size_t N>
constexpr bool rows_follow_enum(const std::array<OpRow<Enum, Fn>, N>& rows) {
  if (N != enum_size<Enum>()) return false;
  for (std::size_t i = 0; i < N; ++i)
    if (static_cast<std::size_t>(rows[i].op) != i || rows[i].fn == nullptr) return false;
  return true;
}

// The function for enum value `e`, rejecting values the payload may carry but
// this runtime does not know.
template <typename Enum, typename Fn, std::size_t N>
const Fn& table_at(const std::array<OpRow<Enum, Fn>, N>& table, Enum e, const char* what) {
  auto i = static_cast<std::size_t>(e);
  if (i >= N) throw NodeError(std::string("unknown ") + what + " " + std::to_string(i));
  return table[i].fn;
}

// op(x + bias) (bias optional, broadcast along x's last axis) with the
// element-wise op table's semantics; on the CPU kernel path one pass, in place
// when x has no other reader (ops/elementwise.cpp).
mx::array unary_op(mlxd::UnaryOp op, const mx::array& x, const std::optional<mx::array>& bias = std::nullopt);

// The CPU kernel (kernels/unary_cpu.h) that computes `op`, if there is one.
enum class UnaryKernel : uint8_t;
std::optional<UnaryKernel> cpu_kernel_for(mlxd::UnaryOp op);

// RMS norm over the last axis: the CPU row kernel where it applies (MLX's CPU norm runs on one core),
// MLX's fused kernel otherwise (norm.cpp).
mx::array rms_norm_last(const mx::array& x, const std::optional<mx::array>& w, float eps);

}  // namespace mlxd::rt
