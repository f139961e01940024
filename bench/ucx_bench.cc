// pippy's UCX transport vs ucx_perftest, two processes, same UCX transport, same sizes,
// in the same run. Bandwidth: a stream of messages with 16 sends in flight and 16
// receives posted, each into its own tensor (ucx_perftest tag_bw receives every message
// into one buffer); latency: half a ping-pong round trip (ucx_perftest tag_lat). pippy's figures
// include what its messages carry on top of UCX: the header with dtype/shape/structure,
// tag matching on (peer, tag), and allocating (or reusing) the received tensor.
//
// Run: bazel run -c opt //bench:ucx_bench [-- --tls tcp,self --sizes 1048576 --reps 5]
// (needs ucx_perftest from ucx-utils)
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "pipeline/transport/ucx/peer_process.h"
#include "pipeline/transport/ucx/ucx_transport.h"

extern char** environ;

namespace {

using namespace pippy::transport;

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Processes this bench started, for the SIGINT/SIGTERM handler: a bench stopped by
// hand must not leave a spinning ucx_perftest or peer behind to skew the next run.
volatile pid_t g_children[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
void Track(pid_t pid, bool add) {
  for (auto& slot : g_children) {
    if (add ? slot == -1 : slot == pid) {
      slot = add ? pid : -1;
      return;
    }
  }
}
void OnStop(int sig) {
  for (pid_t pid : g_children) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  _exit(128 + sig);
}

// A ucx_peer child, known to the stop handler while it lives.
struct TrackedPeer {
  explicit TrackedPeer(const std::vector<std::string>& argv) : peer(argv) { Track(peer.pid(), true); }
  ~TrackedPeer() { Track(peer.pid(), false); }
  ucx::PeerProcess peer;
};

// Pins process `pid` (0: this one, all its threads) to one CPU.
void Pin(pid_t pid, int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(pid, sizeof(set), &set) != 0) std::perror("sched_setaffinity");
}

// CPUs for the sender and the receiver: 0 and 1 where there are two, else unpinned.
int g_send_cpu = -1, g_recv_cpu = -1;

// ucx_peer in `mode`, pinned to the receiver's CPU when pinning.
std::vector<std::string> PeerArgs(const std::string& tls, const std::string& mode) {
  std::vector<std::string> argv = {"pipeline/transport/ucx/ucx_peer", "--tls", tls, "--mode", mode};
  if (g_recv_cpu >= 0) argv.insert(argv.begin(), {"/usr/bin/taskset", "-c", std::to_string(g_recv_cpu)});
  return argv;
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
// `peer_errors`: endpoints in peer error-handling mode with pippy's keepalive and
// shared-memory settings (ucx_perftest -e), as pippy's are: the like-for-like reference.
// Without it, UCX may pick faster protocols (on tcp: zero-copy PUT rendezvous) that it
// does not allow where peer failures must be detected.
std::pair<double, double> Perftest(const std::string& test, int64_t bytes, const std::string& tls, int port,
                                   bool peer_errors) {
  std::string env = absl::StrCat(peer_errors ? "UCX_MM_ERROR_HANDLING=y UCX_KEEPALIVE_INTERVAL=200ms"
                                             : "-u UCX_MM_ERROR_HANDLING",
                                 " UCX_TLS=", tls, tls.find("tcp") != std::string::npos ? " UCX_NET_DEVICES=lo" : "");
  auto pin = [](int cpu) { return cpu < 0 ? std::string() : absl::StrCat(" -c ", cpu); };
  int n = test.find("lat") != std::string::npos ? std::min(2000, Iterations(bytes)) : Iterations(bytes);
  std::string common = absl::StrCat(" -p ", port, " -t ", test, " -s ", bytes, " -n ", n, " -w ", std::max(5, n / 10),
                                    peer_errors ? " -e" : "");
  std::string server = absl::StrCat("exec env ", env, " timeout 120 ucx_perftest", common, pin(g_recv_cpu),
                                    " > /dev/null 2>&1");
  const char* sh[] = {"/bin/sh", "-c", server.c_str(), nullptr};
  pid_t server_pid = -1;
  posix_spawn(&server_pid, sh[0], nullptr, nullptr, const_cast<char**>(sh), environ);
  Track(server_pid, true);
  usleep(300000);
  std::string client = absl::StrCat("env ", env, " timeout 120 ucx_perftest localhost", common, pin(g_send_cpu), " 2>/dev/null");
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
  // The server ends with the test; one that does not (a failed client) is stopped.
  for (int i = 0; i < 40 && waitpid(server_pid, nullptr, WNOHANG) == 0; ++i) usleep(50000);
  if (kill(server_pid, 0) == 0) {
    kill(server_pid, SIGTERM);
    waitpid(server_pid, nullptr, 0);
  }
  Track(server_pid, false);
  return out;
}

// Median, fastest and slowest of `v` (v non-empty).
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double Max(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double Min(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

}  // namespace

// Flags: --tls sm,self|tcp,self (repeatable; default both), --sizes 1048576,4194304,...
// (default 1 KiB .. 64 MiB), --reps N (default 5), --pin 0|1 (default 1), --verbose 1
// (every run), --api 1 (instead: UCP's tag API vs its active messages, both measured
// by ucx_perftest, the choice pippy's transport made). Each size
// is measured N times, alternating pippy and ucx_perftest, so that the machine's drift
// hits both alike. The table shows the best run of each side (interference on a shared
// 2-core VM only ever slows a run down) and, for bandwidth, also the ratio of medians.
int main(int argc, char** argv) {
  signal(SIGINT, OnStop);
  signal(SIGTERM, OnStop);
  std::vector<int64_t> sizes = {1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  std::vector<std::string> transports;
  int reps = 5;
  bool pin = true, verbose = false, api = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--tls") {
      transports.push_back(v);
    } else if (k == "--sizes") {
      sizes.clear();
      for (absl::string_view f : absl::StrSplit(v, ',', absl::SkipEmpty())) sizes.push_back(std::atoll(std::string(f).c_str()));
    } else if (k == "--api") {
      api = v != "0" && v != "false";
    } else if (k == "--verbose") {
      verbose = v != "0" && v != "false";
    } else if (k == "--pin") {
      pin = v != "0" && v != "false";
    } else if (k == "--reps") {
      reps = std::max(1, std::atoi(v.c_str()));
    } else {
      std::fprintf(stderr, "ucx_bench: unknown flag %s (flags: --tls, --sizes, --reps, --pin, --verbose, --api)\n", k.c_str());
      return 2;
    }
  }
  if (transports.empty()) transports = {"sm,self", "tcp,self"};
  if (pin && std::thread::hardware_concurrency() >= 2) {
    g_send_cpu = 0;
    g_recv_cpu = 1;
    Pin(0, g_send_cpu);
  }
  int port = 14100 + getpid() % 500;
  if (api) {
    std::printf("UCP tag matching (tag_bw, tag_lat) vs active messages (ucp_am_bw, ucp_am_lat), both by ucx_perftest -e\n");
    for (const std::string& tls : transports) {
      std::printf("\nUCX_TLS=%s\n%10s | %10s %10s %7s | %8s %8s\n", tls.c_str(), "bytes", "tag MB/s", "AM MB/s", "AM/tag",
                  "tag us", "AM us");
      for (int64_t bytes : sizes) {
        std::vector<double> tb, ab, tl, al;
        for (int rep = 0; rep < reps; ++rep) {
          tb.push_back(Perftest("tag_bw", bytes, tls, port++, true).second);
          ab.push_back(Perftest("ucp_am_bw", bytes, tls, port++, true).second);
          tl.push_back(Perftest("tag_lat", bytes, tls, port++, true).first);
          al.push_back(Perftest("ucp_am_lat", bytes, tls, port++, true).first);
        }
        std::printf("%10lld | %10.0f %10.0f %6.0f%% | %8.2f %8.2f\n", static_cast<long long>(bytes), Max(tb), Max(ab),
                    Max(tb) > 0 ? 100 * Max(ab) / Max(tb) : 0.0, Min(tl), Min(al));
        std::fflush(stdout);
      }
    }
    return 0;
  }
  std::printf("pippy UCX transport vs ucx_perftest (two processes, same UCX_TLS, same sizes; best of %d "
              "alternating runs each; %s)\n", reps,
              g_send_cpu < 0 ? "unpinned" : "sender pinned to CPU 0, receiver to CPU 1, both tools alike");
  for (const std::string& tls : transports) {
    std::printf("\nUCX_TLS=%s%s\n", tls.c_str(), tls.find("tcp") != std::string::npos ? " UCX_NET_DEVICES=lo" : "");
    std::printf("%10s | %10s %10s %7s %8s | %10s %7s | %8s %8s %8s\n", "bytes", "pippy MB/s", "perftest", "ratio",
                "(median)", "no-EH", "ratio", "pippy us", "perftest", "overhead");
    TrackedPeer sink(PeerArgs(tls, "sink")), echo(PeerArgs(tls, "echo"));
    auto bw_t = sink.peer.Connect(ucx::LocalOptions(tls));
    auto lat_t = bw_t.ok() ? echo.peer.Connect(ucx::LocalOptions(tls)) : bw_t.status();
    if (!bw_t.ok() || !lat_t.ok()) {
      std::fprintf(stderr, "ucx_bench: cannot connect to ucx_peer over %s: %s\n", tls.c_str(),
                   std::string((bw_t.ok() ? lat_t.status() : bw_t.status()).message()).c_str());
      return 1;
    }
    uint32_t counter = 0, round = 0;
    for (int64_t bytes : sizes) {
      PippyBandwidth(bw_t->get(), bytes, round++);  // warm-up (buffers, connections)
      std::vector<double> bw, lat, pbw, plat, raw;
      for (int rep = 0; rep < reps; ++rep) {
        bw.push_back(PippyBandwidth(bw_t->get(), bytes, round++));
        lat.push_back(PippyLatency(lat_t->get(), bytes, &counter));
        pbw.push_back(Perftest("tag_bw", bytes, tls, port++, true).second);
        plat.push_back(Perftest("tag_lat", bytes, tls, port++, true).first);
        raw.push_back(Perftest("tag_bw", bytes, tls, port++, false).second);
      }
      if (verbose) {
        for (int rep = 0; rep < reps; ++rep) {
          std::printf("  run %d: pippy %.0f MB/s %.2f us | perftest %.0f MB/s %.2f us | no-EH %.0f MB/s\n", rep, bw[rep],
                      lat[rep], pbw[rep], plat[rep], raw[rep]);
        }
      }
      const double b = Max(bw), l = Min(lat), pb = Max(pbw), pl = Min(plat), r = Max(raw);
      const double median_ratio = Median(pbw) > 0 ? 100 * Median(bw) / Median(pbw) : 0.0;
      std::printf("%10lld | %10.0f %10.0f %6.0f%% %7.0f%% | %10.0f %6.0f%% | %8.2f %8.2f %8.2f\n",
                  static_cast<long long>(bytes), b, pb, pb > 0 ? 100 * b / pb : 0.0, median_ratio, r,
                  r > 0 ? 100 * b / r : 0.0, l, pl, l - pl);
      std::fflush(stdout);
    }
    Tag stop;
    stop.kind = Tag::Kind::kActivation;
    stop.step = round;
    (*bw_t)->Send(1, stop, c10::IValue())->Wait(absl::Seconds(5)).IgnoreError();
  }
  std::printf(
      "\nperftest: ucx_perftest -e (peer error handling, keepalive 200ms, UCX_MM_ERROR_HANDLING=y: pippy's endpoint\n"
      "settings); ratio: pippy bandwidth / its tag_bw, best runs (median: of the medians); overhead: pippy\n"
      "latency - its tag_lat (one way), best runs.\n"
      "no-EH: ucx_perftest tag_bw without error handling, which UCX may run on faster protocols that cannot\n"
      "detect a dead peer (on tcp: zero-copy PUT rendezvous); its ratio shows what failure detection costs.\n");
  return 0;
}
