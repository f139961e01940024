// absl::Status helpers used across every pippy interface.
//
// Policy (docs/errors.md): anything a user, a peer, the network or a file can cause is
// an absl::Status whose message names the thing and says what to do; CHECK is only for
// broken invariants of our own code.
#ifndef PIPPY_COMMON_STATUS_H_
#define PIPPY_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PIPPY_STATUS_CONCAT_INNER_(a, b) a##b
#define PIPPY_STATUS_CONCAT_(a, b) PIPPY_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define PIPPY_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status pippy_status_ = (expr);           \
    if (!pippy_status_.ok()) return pippy_status_;   \
  } while (0)

// `PIPPY_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from an absl::StatusOr or
// returns its error from the enclosing function.
#define PIPPY_ASSIGN_OR_RETURN(lhs, expr) \
  PIPPY_ASSIGN_OR_RETURN_IMPL_(PIPPY_STATUS_CONCAT_(pippy_statusor_, __LINE__), lhs, expr)

#define PIPPY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

namespace pippy {

// Prefixes the message of `status` with `context` ("loading m.pt: ..."), keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace pippy

#endif  // PIPPY_COMMON_STATUS_H_
