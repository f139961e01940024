#include "client/pki.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>  // std::rename
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pippy::pki {
namespace {

namespace fs = std::filesystem;

struct KeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct CertFree {
  void operator()(X509* p) const { X509_free(p); }
};
struct BioFree {
  void operator()(BIO* p) const { BIO_free_all(p); }
};
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Cert = std::unique_ptr<X509, CertFree>;
using Bio = std::unique_ptr<BIO, BioFree>;

constexpr int kCaDays = 3650;

// OpenSSL's most recent error, after `what`.
absl::Status OpenSslError(const std::string& what) {
  const unsigned long e = ERR_get_error();
  char text[256] = "no error queued";
  if (e != 0) ERR_error_string_n(e, text, sizeof text);
  ERR_clear_error();
  return absl::InternalError(absl::StrCat(what, ": OpenSSL: ", text));
}

absl::StatusOr<Key> NewKey() {
  Key key(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));
  if (!key) return OpenSslError("making an ECDSA P-256 key");
  return key;
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return OpenSslError(absl::StrCat("the extension ", OBJ_nid2sn(nid), " = ", value));
  const int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (added != 1) return OpenSslError(absl::StrCat("adding ", OBJ_nid2sn(nid)));
  return absl::OkStatus();
}

struct Extension {
  int nid;
  std::string value;
};

// A certificate for `key` named `cn`, signed by `issuer` with `issuer_key` (or
// self-signed when `issuer` is null).
absl::StatusOr<Cert> Issue(const std::string& cn, EVP_PKEY* key, X509* issuer, EVP_PKEY* issuer_key, int days,
                           const std::vector<Extension>& extensions) {
  Cert cert(X509_new());
  if (!cert) return OpenSslError("X509_new");
  X509_set_version(cert.get(), 2);  // v3
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof serial) != 1) return OpenSslError("a random serial number");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  const bool serial_set = bn != nullptr && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr;
  BN_free(bn);
  if (!serial_set) return OpenSslError("the serial number");
  // Valid from an hour ago: clocks between hosts differ.
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>("pippy"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1,
                             0);
  X509* signer = issuer != nullptr ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  for (const Extension& e : extensions) {
    absl::Status s = AddExtension(cert.get(), signer, e.nid, e.value);
    if (!s.ok()) return s;
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) == 0) return OpenSslError(absl::StrCat("signing ", cn));
  return cert;
}

// Writes `bytes` to `path` with `mode`, through a temporary file renamed into place.
absl::Status WriteFile(const std::string& path, const std::string& bytes, mode_t mode) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot write '", tmp, "': ", std::strerror(errno)));
  fchmod(fd, mode);  // whatever the umask
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("writing '", tmp, "' failed: ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string BioBytes(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> CertPem(X509* cert) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) return OpenSslError("writing a certificate as PEM");
  return BioBytes(bio.get());
}

absl::StatusOr<std::string> KeyPem(EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslError("writing a key as PEM");
  }
  return BioBytes(bio.get());
}

absl::StatusOr<std::pair<Cert, Key>> LoadCa(const std::string& dir) {
  Bio cert_bio(BIO_new_file((dir + "/ca.pem").c_str(), "r"));
  Bio key_bio(BIO_new_file((dir + "/ca.key").c_str(), "r"));
  if (!cert_bio || !key_bio) {
    ERR_clear_error();
    return absl::FailedPreconditionError(absl::StrCat("--renew: no CA in ", dir, " (ca.pem and ca.key); make one with "
                                                      "pippyctl certs init DIR (without --renew)"));
  }
  Cert cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  Key key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (!cert || !key) return OpenSslError(absl::StrCat("reading the CA in ", dir));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::FailedPreconditionError(absl::StrCat(dir, "/ca.key is not the key of ", dir, "/ca.pem"));
  }
  return std::make_pair(std::move(cert), std::move(key));
}

absl::StatusOr<std::string> RandomToken() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof bytes) != 1) return OpenSslError("a random token");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

bool IsAddress(const std::string& name) {
  unsigned char buf[16];
  return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

std::string HostName() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "";
  return host;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> Init(const Options& o) {
  if (o.dir.empty()) return absl::InvalidArgumentError("DIR: missing");
  if (o.days < 1 || o.days > kCaDays) {
    return absl::InvalidArgumentError(absl::StrCat("--days ", o.days, ": give 1 to ", kCaDays));
  }
  if (o.users.empty()) return absl::InvalidArgumentError("--user: give at least one");
  for (const std::string& u : o.users) {
    if (u.empty() || u.find_first_of(" \t\r\n#/") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--user '", u, "': a name without spaces, '#' or '/'"));
    }
  }
  std::vector<std::string> names = {"localhost", "127.0.0.1"};
  if (const std::string host = HostName(); !host.empty() && host != "localhost") names.push_back(host);
  for (const std::string& n : o.server_names) {
    if (n.empty() || n.find_first_of(", \t") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--name '", n, "': one DNS name or IP address"));
    }
    names.push_back(n);
  }
  std::error_code ec;
  fs::create_directories(o.dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create '", o.dir, "': ", ec.message()));
  chmod(o.dir.c_str(), 0700);
  const std::vector<std::string> made = {"ca.pem", "ca.key", "server.pem", "server.key", "worker.pem", "worker.key",
                                         "tokens"};
  if (!o.renew) {
    for (const std::string& f : made) {
      if (fs::exists(o.dir + "/" + f)) {
        return absl::AlreadyExistsError(absl::StrCat(o.dir, "/", f, " exists: give an empty DIR, or --renew to issue "
                                                     "the certificates again with the CA there"));
      }
    }
  }
  std::vector<std::string> written;
  auto write = [&](const std::string& name, const absl::StatusOr<std::string>& bytes, mode_t mode) -> absl::Status {
    if (!bytes.ok()) return bytes.status();
    absl::Status s = WriteFile(o.dir + "/" + name, *bytes, mode);
    if (s.ok()) written.push_back(o.dir + "/" + name);
    return s;
  };

  Cert ca;
  Key ca_key;
  if (o.renew) {
    auto loaded = LoadCa(o.dir);
    if (!loaded.ok()) return loaded.status();
    ca = std::move(loaded->first);
    ca_key = std::move(loaded->second);
  } else {
    auto key = NewKey();
    if (!key.ok()) return key.status();
    ca_key = std::move(*key);
    auto cert = Issue("pippy CA", ca_key.get(), nullptr, ca_key.get(), kCaDays,
                      {{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                       {NID_key_usage, "critical,keyCertSign,cRLSign"},
                       {NID_subject_key_identifier, "hash"},
                       {NID_authority_key_identifier, "keyid:always"}});
    if (!cert.ok()) return cert.status();
    ca = std::move(*cert);
    if (auto s = write("ca.key", KeyPem(ca_key.get()), 0600); !s.ok()) return s;
    if (auto s = write("ca.pem", CertPem(ca.get()), 0644); !s.ok()) return s;
  }

  std::vector<std::string> sans;
  for (const std::string& n : names) sans.push_back(absl::StrCat(IsAddress(n) ? "IP:" : "DNS:", n));
  struct Leaf {
    std::string file, cn, usage;
    bool server;
  };
  for (const Leaf& leaf : {Leaf{"server", "pippy-coordinator", "serverAuth", true},
                           Leaf{"worker", "pippy-worker", "clientAuth", false}}) {
    auto key = NewKey();
    if (!key.ok()) return key.status();
    std::vector<Extension> ext = {{NID_basic_constraints, "critical,CA:FALSE"},
                                  {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
                                  {NID_ext_key_usage, leaf.usage},
                                  {NID_subject_key_identifier, "hash"},
                                  {NID_authority_key_identifier, "keyid:always"}};
    if (leaf.server) ext.push_back({NID_subject_alt_name, absl::StrJoin(sans, ",")});
    auto cert = Issue(leaf.cn, key->get(), ca.get(), ca_key.get(), o.days, ext);
    if (!cert.ok()) return cert.status();
    if (auto s = write(leaf.file + ".key", KeyPem(key->get()), 0600); !s.ok()) return s;
    if (auto s = write(leaf.file + ".pem", CertPem(cert->get()), 0644); !s.ok()) return s;
  }

  if (!o.renew || !fs::exists(o.dir + "/tokens")) {
    std::string tokens = "# pippy user tokens, \"NAME TOKEN\" per line: pippy-coordinator --auth-token-file\n";
    for (const std::string& u : o.users) {
      auto token = RandomToken();
      if (!token.ok()) return token.status();
      tokens += absl::StrCat(u, " ", *token, "\n");
      if (auto s = write("token-" + u, *token + "\n", 0600); !s.ok()) return s;
    }
    if (auto s = write("tokens", tokens, 0600); !s.ok()) return s;
  }
  return written;
}

}  // namespace pippy::pki
