// `pippyctl certs init DIR`: the CA, certificates and tokens of a secured deployment
// (client/pki.h), and the flags that use them.
#include <iostream>
#include <memory>

#include "client/commands.h"
#include "client/pki.h"
#include "common/cli.h"

namespace pippy::cli {
namespace {

int RunCertsInit(const pki::Options& o) {
  auto written = pki::Init(o);
  if (!written.ok()) return Fail(kProgram, written.status());
  for (const std::string& f : *written) std::cout << "wrote " << f << "\n";
  const std::string& d = o.dir;
  std::cout << "\nThe coordinator (listens on every address once all three are given):\n"
            << "  pippy-coordinator --tls-cert " << d << "/server.pem --tls-key " << d << "/server.key --tls-client-ca "
            << d << "/ca.pem --auth-token-file " << d << "/tokens\n"
            << "Each worker (copy ca.pem, worker.pem and worker.key to its host):\n"
            << "  pippy-worker --coordinator HOST:7070 --tls-ca " << d << "/ca.pem --tls-cert " << d
            << "/worker.pem --tls-key " << d << "/worker.key\n"
            << "Each user (their token-NAME file):\n"
            << "  pippyctl --coordinator HOST:7070 --tls-ca " << d << "/ca.pem --token-file " << d << "/token-"
            << o.users.front() << " list\n";
  return kExitOk;
}

}  // namespace

void AddCertsCommand(CLI::App& root, int* exit_code) {
  CLI::App* certs = root.add_subcommand("certs", "Certificates and tokens for a secured coordinator");
  certs->require_subcommand(1);
  auto o = std::make_shared<pki::Options>();
  auto users = std::make_shared<std::vector<std::string>>();
  CLI::App* init = certs->add_subcommand(
      "init",
      "Make a CA, the coordinator's certificate, the workers' client certificate (mTLS) and user tokens in DIR "
      "(ECDSA P-256; keys and tokens 0600). --renew issues the two certificates again with the CA already in DIR "
      "(rotation: workers keep trusting the same CA) and keeps the tokens.");
  init->add_option("DIR", o->dir, "where to write them")->required();
  init->add_option("--name", o->server_names,
                   "a DNS name or IP address clients reach the coordinator by (repeatable; localhost, 127.0.0.1 and "
                   "this host's name are always in)");
  init->add_option("--user", *users, "a user to give a token (repeatable; default admin)");
  init->add_option("--days", o->days, "validity of the coordinator's and workers' certificates")
      ->check(CLI::Range(1, 3650))->capture_default_str();
  init->add_flag("--renew", o->renew, "keep the CA and tokens in DIR; issue the certificates again");
  init->callback([o, users, exit_code] {
    if (!users->empty()) o->users = *users;
    *exit_code = RunCertsInit(*o);
  });
}

}  // namespace pippy::cli
