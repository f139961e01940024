// pippy's UCX transport vs ucx_perftest, two processes, same UCX transport, same sizes,
// in the same run. Bandwidth: a stream of messages with 16 in flight (ucx_perftest
// tag_bw); latency: half a ping-pong round trip (ucx_perftest tag_lat). pippy's figures
// include what its messages carry on top of UCX: the header with dtype/shape/structure,
// tag matching on (peer, tag), and allocating (or reusing) the received tensor.
//
// Run: bazel run -c opt //bench:ucx_bench   (needs ucx_perftest from ucx-utils)
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>

#include "ATen/ATen.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "pipeline/transport/ucx/ucx_transport.h"

extern char** environ;

namespace {

using namespace pippy::transport;

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Child {
  pid_t pid = -1;
  FILE* to = nullptr;
  FILE* from = nullptr;
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

void Spawn(Child* c, const std::vector<std::string>& args) {
  int to_child[2], from_child[2];
  (void)!pipe(to_child);
  (void)!pipe(from_child);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
  posix_spawn_file_actions_addclose(&fa, to_child[1]);
  posix_spawn_file_actions_addclose(&fa, from_child[0]);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn(&c->pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(to_child[0]);
  close(from_child[1]);
  c->to = fdopen(to_child[1], "w");
  c->from = fdopen(from_child[0], "r");
}

std::unique_ptr<ucx::UcxTransport> ConnectTo(Child* c, const std::string& tls) {
  ucx::Options o;
  o.ucx_config = {{"TLS", tls}};
  if (tls.find("tcp") != std::string::npos) o.ucx_config.push_back({"NET_DEVICES", "lo"});
  auto t = std::move(*ucx::UcxTransport::Create(0, 2, o));
  char buf[8192];
  std::string addr;
  while (fgets(buf, sizeof(buf), c->from)) {
    std::string line(buf);
    if (line.rfind("ADDRESS ", 0) == 0) {
      addr = absl::HexStringToBytes(std::string(absl::StripTrailingAsciiWhitespace(line.substr(8))));
      break;
    }
  }
  fprintf(c->to, "%s\n", absl::BytesToHexString(t->address()).c_str());
  fflush(c->to);
  absl::Status s = t->Connect({t->address(), addr});
  if (!s.ok()) fprintf(stderr, "connect: %s\n", std::string(s.message()).c_str());
  return t;
}

int Iterations(int64_t bytes) { return static_cast<int>(std::max<int64_t>(20, std::min<int64_t>(20000, (512LL << 20) / bytes))); }

// pippy bandwidth in MB/s (10^6 bytes, as ucx_perftest reports).
double PippyBandwidth(ucx::UcxTransport* t, int64_t bytes, uint32_t round) {
  const int n = Iterations(bytes);
  at::Tensor x = at::ones({bytes / 4}, at::kFloat);
  Tag t0;
  t0.kind = Tag::Kind::kActivation;
  t0.step = round;
  t0.microbatch = 0;
  auto ack = t->Recv(1, t0);
  t->Send(1, t0, c10::IValue(int64_t{n}));
  double start = Now();
  std::deque<std::shared_ptr<Work>> window;
  for (int i = 1; i <= n; ++i) {
    Tag ti = t0;
    ti.microbatch = static_cast<uint32_t>(i % 4096);
    window.push_back(t->Send(1, ti, x));
    if (window.size() >= 16) {
      window.front()->Wait(absl::Seconds(60)).IgnoreError();
      window.pop_front();
    }
  }
  for (auto& w : window) w->Wait(absl::Seconds(60)).IgnoreError();
  ack->Wait(absl::Seconds(60)).IgnoreError();
  return static_cast<double>(bytes) * n / (Now() - start) / 1e6;
}

// pippy one-way latency in microseconds (half the round trip).
double PippyLatency(ucx::UcxTransport* t, int64_t bytes, uint32_t* counter) {
  const int n = std::min(2000, Iterations(bytes));
  at::Tensor x = at::ones({std::max<int64_t>(bytes / 4, 1)}, at::kFloat);
  Tag tag;
  tag.kind = Tag::Kind::kActivation;
  double best = 1e30;
  for (int rep = 0; rep < 2; ++rep) {  // the first pass warms up
    double start = Now();
    for (int i = 0; i < n; ++i) {
      tag.microbatch = (*counter)++ % 4096;
      auto r = t->Recv(1, tag);
      t->Send(1, tag, x);
      r->Wait(absl::Seconds(60)).IgnoreError();
    }
    best = std::min(best, (Now() - start) / n / 2 * 1e6);
  }
  return best;
}

// Runs ucx_perftest server + client; returns {avg latency us, avg bandwidth MB/s}.
std::pair<double, double> Perftest(const std::string& test, int64_t bytes, const std::string& tls, int port) {
  std::string env = absl::StrCat("UCX_TLS=", tls, tls.find("tcp") != std::string::npos ? " UCX_NET_DEVICES=lo" : "");
  int n = test == "tag_lat" ? std::min(2000, Iterations(bytes)) : Iterations(bytes);
  std::string common = absl::StrCat(" -p ", port, " -t ", test, " -s ", bytes, " -n ", n, " -w ", std::max(5, n / 10));
  std::string server = absl::StrCat("env ", env, " timeout 120 ucx_perftest", common, " > /dev/null 2>&1 &");
  (void)!system(server.c_str());
  usleep(300000);
  std::string client = absl::StrCat("env ", env, " timeout 120 ucx_perftest localhost", common, " 2>/dev/null");
  FILE* p = popen(client.c_str(), "r");
  char buf[1024];
  std::pair<double, double> out{0, 0};
  while (p && fgets(buf, sizeof(buf), p)) {
    std::string line(buf);
    if (line.rfind("Final:", 0) != 0) continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    // Final: iters p50 avg_lat overall_lat avg_bw overall_bw avg_rate overall_rate
    if (f.size() >= 7) out = {std::atof(f[3].c_str()), std::atof(f[5].c_str())};
  }
  if (p) pclose(p);
  return out;
}

}  // namespace

int main() {
  const std::string peer = "pipeline/transport/ucx/ucx_peer";
  const std::vector<int64_t> sizes = {1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  int port = 14100 + getpid() % 500;
  std::printf("pippy UCX transport vs ucx_perftest (two processes, same UCX_TLS, same sizes)\n");
  for (const std::string tls : {"sm,self", "tcp,self"}) {
    std::printf("\nUCX_TLS=%s%s\n", tls.c_str(), tls.find("tcp") != std::string::npos ? " UCX_NET_DEVICES=lo" : "");
    std::printf("%10s | %12s %12s %7s | %10s %10s %10s\n", "bytes", "pippy MB/s", "perftest", "ratio",
                "pippy us", "perftest", "overhead");
    Child sink, echo;
    Spawn(&sink, {peer, "--tls", tls, "--mode", "sink"});
    auto bw_t = ConnectTo(&sink, tls);
    Spawn(&echo, {peer, "--tls", tls, "--mode", "echo"});
    auto lat_t = ConnectTo(&echo, tls);
    uint32_t counter = 0, round = 0;
    for (int64_t bytes : sizes) {
      PippyBandwidth(bw_t.get(), bytes, round++);  // warm-up (buffers, connections)
      double bw = PippyBandwidth(bw_t.get(), bytes, round++);
      double lat = PippyLatency(lat_t.get(), bytes, &counter);
      auto pbw = Perftest("tag_bw", bytes, tls, port++);
      auto plat = Perftest("tag_lat", bytes, tls, port++);
      std::printf("%10lld | %12.0f %12.0f %6.0f%% | %10.2f %10.2f %10.2f\n", static_cast<long long>(bytes), bw,
                  pbw.second, pbw.second > 0 ? 100 * bw / pbw.second : 0.0, lat, plat.first, lat - plat.first);
      std::fflush(stdout);
    }
    Tag stop;
    stop.kind = Tag::Kind::kActivation;
    stop.step = round;
    bw_t->Send(1, stop, c10::IValue())->Wait(absl::Seconds(5)).IgnoreError();
  }
  std::printf("\nratio: pippy bandwidth / ucx_perftest tag_bw; overhead: pippy latency - ucx_perftest tag_lat\n");
  return 0;
}
