// pippyctl certs init's files, checked with OpenSSL's own verification (a chain to
// the CA, purposes, names), not with the code that made them.
#include "client/pki.h"

#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pippy::pki {
namespace {

using ::testing::HasSubstr;

struct CertFree {
  void operator()(X509* p) const { X509_free(p); }
};
using Cert = std::unique_ptr<X509, CertFree>;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Cert LoadCert(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return nullptr;
  Cert c(PEM_read_X509(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  return c;
}

bool KeyMatches(X509* cert, const std::string& key_path) {
  FILE* f = std::fopen(key_path.c_str(), "r");
  if (f == nullptr) return false;
  EVP_PKEY* key = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  const bool ok = key != nullptr && X509_check_private_key(cert, key) == 1;
  EVP_PKEY_free(key);
  return ok;
}

// X509_verify_cert of `leaf` against `ca` alone, for `purpose`; its error text or "".
std::string Verify(X509* ca, X509* leaf, int purpose) {
  X509_STORE* store = X509_STORE_new();
  X509_STORE_add_cert(store, ca);
  X509_STORE_CTX* ctx = X509_STORE_CTX_new();
  X509_STORE_CTX_init(ctx, store, leaf, nullptr);
  X509_STORE_CTX_set_purpose(ctx, purpose);
  const int ok = X509_verify_cert(ctx);
  std::string error = ok == 1 ? "" : X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx));
  X509_STORE_CTX_free(ctx);
  X509_STORE_free(store);
  return error;
}

int Mode(const std::string& path) {
  struct stat st {};
  stat(path.c_str(), &st);
  return st.st_mode & 0777;
}

class PkiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/pki-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(PkiTest, Init_MakesACaThatSignsTheServerAndWorkerCertificatesForTheirPurposes) {
  Options o;
  o.dir = dir_;
  o.server_names = {"coord.example", "10.1.2.3"};
  o.users = {"alice", "bob"};
  auto written = Init(o);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->size(), 9u);  // 6 PEM files, 2 user tokens, the token file
  Cert ca = LoadCert(dir_ + "/ca.pem"), server = LoadCert(dir_ + "/server.pem"), worker = LoadCert(dir_ + "/worker.pem");
  ASSERT_TRUE(ca && server && worker);
  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  EXPECT_EQ(Verify(ca.get(), server.get(), X509_PURPOSE_SSL_SERVER), "");
  EXPECT_EQ(Verify(ca.get(), worker.get(), X509_PURPOSE_SSL_CLIENT), "");
  // Each only for its own purpose; a leaf is no CA.
  EXPECT_NE(Verify(ca.get(), worker.get(), X509_PURPOSE_SSL_SERVER), "");
  EXPECT_NE(Verify(ca.get(), server.get(), X509_PURPOSE_SSL_CLIENT), "");
  EXPECT_EQ(X509_check_ca(server.get()), 0);
  // The names clients reach the coordinator by, and no other.
  EXPECT_EQ(X509_check_host(server.get(), "localhost", 0, 0, nullptr), 1);
  EXPECT_EQ(X509_check_host(server.get(), "coord.example", 0, 0, nullptr), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "127.0.0.1", 0), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "10.1.2.3", 0), 1);
  EXPECT_EQ(X509_check_host(server.get(), "other.example", 0, 0, nullptr), 0);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "10.1.2.4", 0), 0);
  // Keys are those of the certificates, and private.
  for (const char* name : {"ca", "server", "worker"}) {
    const std::string key = dir_ + "/" + name + ".key";
    EXPECT_TRUE(KeyMatches(LoadCert(dir_ + "/" + name + ".pem").get(), key)) << name;
    EXPECT_EQ(Mode(key), 0600) << key;
  }
  EXPECT_EQ(Mode(dir_ + "/tokens"), 0600);
}

TEST_F(PkiTest, Init_WritesOneDistinctTokenPerUser_InTheTokenFileAndAlone) {
  Options o;
  o.dir = dir_;
  o.users = {"alice", "bob"};
  ASSERT_TRUE(Init(o).ok());
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(Slurp(dir_ + "/tokens"), '\n', absl::SkipEmpty())) {
    if (l[0] != '#') lines.emplace_back(l);
  }
  ASSERT_EQ(lines.size(), 2u);
  std::vector<std::string> alice = absl::StrSplit(lines[0], ' '), bob = absl::StrSplit(lines[1], ' ');
  ASSERT_EQ(alice.size(), 2u);
  ASSERT_EQ(bob.size(), 2u);
  EXPECT_EQ(alice[0], "alice");
  EXPECT_EQ(bob[0], "bob");
  EXPECT_EQ(alice[1].size(), 64u);
  EXPECT_EQ(alice[1].find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(alice[1], bob[1]);
  EXPECT_EQ(Slurp(dir_ + "/token-alice"), alice[1] + "\n");
  EXPECT_EQ(Slurp(dir_ + "/token-bob"), bob[1] + "\n");
  EXPECT_EQ(Mode(dir_ + "/token-alice"), 0600);
}

TEST_F(PkiTest, Renew_KeepsTheCaAndTokens_IssuesNewCertificatesTheOldCaVerifies) {
  Options o;
  o.dir = dir_;
  ASSERT_TRUE(Init(o).ok());
  const std::string ca_before = Slurp(dir_ + "/ca.pem"), server_before = Slurp(dir_ + "/server.pem");
  const std::string tokens_before = Slurp(dir_ + "/tokens");
  // Without --renew, a DIR that holds them is refused and left alone.
  auto again = Init(o);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("--renew"));
  EXPECT_EQ(Slurp(dir_ + "/server.pem"), server_before);
  o.renew = true;
  auto renewed = Init(o);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(Slurp(dir_ + "/ca.pem"), ca_before);
  EXPECT_EQ(Slurp(dir_ + "/tokens"), tokens_before);
  EXPECT_NE(Slurp(dir_ + "/server.pem"), server_before);
  Cert ca = LoadCert(dir_ + "/ca.pem"), server = LoadCert(dir_ + "/server.pem");
  EXPECT_EQ(Verify(ca.get(), server.get(), X509_PURPOSE_SSL_SERVER), "");
  EXPECT_TRUE(KeyMatches(server.get(), dir_ + "/server.key"));
}

TEST_F(PkiTest, BadInput_IsRefusedNamingIt) {
  Options o;
  o.dir = dir_;
  o.renew = true;
  auto no_ca = Init(o);
  EXPECT_EQ(no_ca.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_ca.status().message(), HasSubstr("no CA"));
  o.renew = false;
  o.users = {"two words"};
  auto bad_user = Init(o);
  EXPECT_EQ(bad_user.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_user.status().message(), HasSubstr("--user 'two words'"));
  o.users = {"admin"};
  o.server_names = {"a,b"};
  auto bad_name = Init(o);
  EXPECT_EQ(bad_name.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_name.status().message(), HasSubstr("--name 'a,b'"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/ca.pem"));
}

}  // namespace
}  // namespace pippy::pki
