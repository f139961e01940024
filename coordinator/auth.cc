#include "coordinator/auth.h"

#include <fstream>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pippy::coordinator {
namespace {

// Compares without returning early on the first difference (no timing oracle).
bool SameToken(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size() || a.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--auth-token-file: cannot read '", path, "'"));
  std::unique_ptr<TokenAuth> auth(new TokenAuth());
  std::set<std::string> names, tokens;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    std::vector<std::string> parts = absl::StrSplit(l, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat("--auth-token-file ", path, " line ", n);
    if (parts.size() != 2) return absl::InvalidArgumentError(absl::StrCat(where, ": expected \"NAME TOKEN\""));
    if (parts[1].size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token of ", parts[0],
                                                     " is shorter than 16 characters (openssl rand -hex 24 makes one)"));
    }
    if (!names.insert(parts[0]).second) return absl::InvalidArgumentError(absl::StrCat(where, ": ", parts[0], " twice"));
    if (!tokens.insert(parts[1]).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a token given to two users"));
    }
    auth->users_.emplace_back(parts[0], parts[1]);
  }
  if (auth->users_.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth-token-file ", path, ": no users"));
  return auth;
}

absl::StatusOr<std::string> TokenAuth::UserOf(absl::string_view authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("no token: send \"authorization: Bearer TOKEN\" (pippyctl --token-file or "
                                      "PIPPY_TOKEN)");
  }
  if (!absl::StartsWith(authorization, "Bearer ")) {
    return absl::UnauthenticatedError("the authorization header must be \"Bearer TOKEN\"");
  }
  const absl::string_view token = authorization.substr(7);
  std::string user;
  for (const auto& [name, t] : users_) {
    if (SameToken(token, t) && user.empty()) user = name;
  }
  if (user.empty()) return absl::UnauthenticatedError("unknown token");
  return user;
}

}  // namespace pippy::coordinator
