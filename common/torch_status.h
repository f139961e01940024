// The boundary between LibTorch's exceptions and pippy's absl::Status.
//
// LibTorch reports errors by throwing c10::Error (and occasionally std::exception);
// no exception may cross a pippy component boundary, so every call into LibTorch that
// can fail because of user data runs inside TorchCall(), which turns the exception
// into a Status with the given context and the first line of LibTorch's message
// (without its C++ backtrace).
#ifndef PIPPY_COMMON_TORCH_STATUS_H_
#define PIPPY_COMMON_TORCH_STATUS_H_

#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "c10/util/Exception.h"

namespace pippy {

// LibTorch's message without the C++ backtrace LibTorch appends.
std::string TorchErrorMessage(const c10::Error& e);

// Runs `fn` and converts any exception into absl::Status `code` prefixed by `context`.
// `fn` returns void, absl::Status, T or absl::StatusOr<T>.
namespace internal {
template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {};
}  // namespace internal

template <typename Fn>
auto TorchCall(absl::string_view context, Fn&& fn,
               absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  using R = std::invoke_result_t<Fn>;
  using Out = std::conditional_t<
      std::is_void_v<R> || std::is_same_v<R, absl::Status>, absl::Status,
      std::conditional_t<internal::IsStatusOr<R>::value, R, absl::StatusOr<R>>>;
  auto fail = [&](const std::string& what) -> Out {
    return absl::Status(code, absl::StrCat(context, ": ", what));
  };
  try {
    if constexpr (std::is_void_v<R>) {
      std::forward<Fn>(fn)();
      return Out(absl::OkStatus());
    } else {
      return Out(std::forward<Fn>(fn)());
    }
  } catch (const c10::Error& e) {
    return fail(TorchErrorMessage(e));
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

}  // namespace pippy

#endif  // PIPPY_COMMON_TORCH_STATUS_H_
