#include "common/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pippy::tls {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream s;
  s << in.rdbuf();
  std::string pem = s.str();
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is not a PEM file"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerFiles& f) {
  if (f.cert.empty() && f.key.empty()) {
    if (!f.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too");
    }
    return grpc::InsecureServerCredentials();
  }
  if (f.cert.empty() || f.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  grpc::SslServerCredentialsOptions o;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  PIPPY_ASSIGN_OR_RETURN(std::string cert, ReadPem(f.cert, "--tls-cert"));
  PIPPY_ASSIGN_OR_RETURN(std::string key, ReadPem(f.key, "--tls-key"));
  pair.cert_chain = cert;
  pair.private_key = key;
  o.pem_key_cert_pairs.push_back(pair);
  if (!f.client_ca.empty()) {
    PIPPY_ASSIGN_OR_RETURN(std::string ca, ReadPem(f.client_ca, "--tls-client-ca"));
    o.pem_root_certs = ca;
    // Clients may come without a certificate (users); one that is presented must be
    // valid, and WorkerHub requires one (grpc_service.h).
    o.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientFiles& f) {
  if (f.ca.empty()) {
    if (!f.cert.empty() || !f.key.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key need --tls-ca (the CA of the coordinator)");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (f.cert.empty() != f.key.empty()) return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  grpc::SslCredentialsOptions o;
  PIPPY_ASSIGN_OR_RETURN(std::string ca, ReadPem(f.ca, "--tls-ca"));
  o.pem_root_certs = ca;
  if (!f.cert.empty()) {
    PIPPY_ASSIGN_OR_RETURN(std::string cert, ReadPem(f.cert, "--tls-cert"));
    PIPPY_ASSIGN_OR_RETURN(std::string key, ReadPem(f.key, "--tls-key"));
    o.pem_cert_chain = cert;
    o.pem_private_key = key;
  }
  return grpc::SslCredentials(o);
}

}  // namespace pippy::tls
