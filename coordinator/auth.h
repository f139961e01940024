// User tokens for the Coordinator service (--auth-token-file): one user per line,
// "NAME TOKEN" (blank lines and #-comments skipped). Every Coordinator RPC must carry
// "authorization: Bearer TOKEN"; the token names the user, whom the job records as its
// submitter (only they may cancel it). Tokens are compared in constant time and never
// logged. WorkerHub is not covered: workers authenticate with mTLS (--tls-client-ca).
#ifndef PIPPY_COORDINATOR_AUTH_H_
#define PIPPY_COORDINATOR_AUTH_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pippy::coordinator {

class TokenAuth {
 public:
  // Errors: INVALID_ARGUMENT naming the file and line (a line without a token, a token
  // shorter than 16 characters, a name or token used twice, no users at all).
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Load(const std::string& path);

  // The user whose token `authorization` ("Bearer TOKEN") carries.
  // Errors: UNAUTHENTICATED (missing, malformed or unknown; the message never holds it).
  absl::StatusOr<std::string> UserOf(absl::string_view authorization) const;

  size_t users() const { return users_.size(); }

 private:
  TokenAuth() = default;
  std::vector<std::pair<std::string, std::string>> users_;  // (name, token)
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_AUTH_H_
