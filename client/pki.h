// `pippyctl certs init DIR`: everything a secured deployment needs, made in one
// command with OpenSSL's library (no `openssl` program needed):
//
//   DIR/ca.pem, ca.key          a certificate authority (ECDSA P-256, 10 years)
//   DIR/server.pem, server.key  the coordinator's certificate (serverAuth; names:
//                               localhost, 127.0.0.1, this host's name, --name ...)
//   DIR/worker.pem, worker.key  the workers' client certificate (clientAuth, mTLS)
//   DIR/tokens                  "NAME TOKEN" per user, for --auth-token-file
//   DIR/token-NAME              that user's token alone, for pippyctl --token-file
//
// Keys and tokens are written 0600. With `renew`, the CA (which must exist) is kept
// and the server and worker certificates are issued again; tokens are kept too
// (certificate rotation without touching the workers' trust, docs/security.md).
#ifndef PIPPY_CLIENT_PKI_H_
#define PIPPY_CLIENT_PKI_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pippy::pki {

struct Options {
  std::string dir;
  // Extra names of the coordinator (DNS names or IP addresses) its certificate covers.
  std::vector<std::string> server_names;
  // Users given a token (default: one, "admin").
  std::vector<std::string> users = {"admin"};
  int days = 365;      // validity of the server and worker certificates
  bool renew = false;  // keep the CA and tokens, issue the certificates again
};

// Returns the files written. Errors: ALREADY_EXISTS when DIR already holds them
// (without renew), FAILED_PRECONDITION for renew without a CA, INVALID_ARGUMENT for a
// user name that cannot be one (spaces, empty), UNAVAILABLE naming a file that cannot
// be written, INTERNAL when OpenSSL fails (its error text).
absl::StatusOr<std::vector<std::string>> Init(const Options& options);

}  // namespace pippy::pki

#endif  // PIPPY_CLIENT_PKI_H_
