// TLS for pippy's gRPC connections, from PEM files: the coordinator's server
// credentials (optionally asking clients for certificates signed by a CA: mTLS for
// workers), and the client side for workers and pippyctl. Without files, plain
// (insecure) credentials: TLS is opt-in.
#ifndef PIPPY_COMMON_TLS_H_
#define PIPPY_COMMON_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace pippy::tls {

struct ServerFiles {
  std::string cert, key;  // both or neither
  std::string client_ca;  // optional: verify client certificates presented against it
};
// Errors: INVALID_ARGUMENT naming the flag whose file is missing, unreadable or not
// PEM, or a key without its certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerFiles& files);

struct ClientFiles {
  std::string ca;         // the CA that signed the coordinator's certificate: TLS on
  std::string cert, key;  // optional: this client's certificate (mTLS)
};
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientFiles& files);

}  // namespace pippy::tls

#endif  // PIPPY_COMMON_TLS_H_
