// Helpers shared by the exec_<Node> functions in cpp/ops/. No op bodies here.
#pragma once

#include <string>

#include "ops_generated.h"
#include "runtime.h"

namespace mlxd::rt {

// Looks up the row for enum value `e` in an op table, rejecting values the
// payload may carry but this runtime does not know.
template <typename Table, typename Enum>
const typename Table::value_type& table_at(const Table& table, Enum e, const char* what) {
  auto i = static_cast<size_t>(e);
  if (i >= table.size()) throw NodeError(std::string("unknown ") + what + " " + std::to_string(i));
  return table[i];
}

}  // namespace mlxd::rt
