// A peer process for UCX tests and benchmarks: rank 1 of 2.
//
//   ucx_peer --tls TLS --mode echo|stream|burst|sink [--bytes N] [--iters N]
//
// Prints "ADDRESS <hex>" (its worker address) on stdout, reads rank 0's from stdin, connects, then:
//   echo      receives values (tag mb = 0, 1, ...) and sends each back, until a
//             receive fails (rank 0 gone or a None value: stop)
//   stream    sends N-byte tensors forever (tag mb = i) — to be killed mid-transfer
//   burst     sends `iters` messages of `bytes` (mb = 0, 1, ...), then exits at once
//   sink      receives `iters` messages, then sends one ack (bandwidth benchmark);
//             repeats for every round until rank 0 sends None
#include <unistd.h>

#include <deque>
#include <iostream>
#include <string>

#include "ATen/ATen.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "pipeline/transport/ucx/peer_process.h"
#include "pipeline/transport/ucx/ucx_transport.h"

using namespace pippy::transport;

int main(int argc, char** argv) {
  std::string tls = "tcp,self", mode = "echo";
  int64_t bytes = 1 << 20, iters = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--tls") tls = v;
    else if (k == "--mode") mode = v;
    else if (k == "--bytes") (void)absl::SimpleAtoi(v, &bytes);
    else if (k == "--iters") (void)absl::SimpleAtoi(v, &iters);
  }
  auto t = ucx::UcxTransport::Create(1, 2, ucx::LocalOptions(tls));
  if (!t.ok()) {
    std::cerr << "ucx_peer: " << t.status() << "\n";
    return 1;
  }
  std::cout << "ADDRESS " << absl::BytesToHexString((*t)->address()) << std::endl;
  std::string line;
  if (!std::getline(std::cin, line)) return 1;
  std::vector<std::string> addrs = {absl::HexStringToBytes(line), (*t)->address()};
  absl::Status c = (*t)->Connect(addrs);
  if (!c.ok()) {
    std::cerr << "ucx_peer: " << c << "\n";
    return 1;
  }
  Tag tag;
  tag.kind = Tag::Kind::kActivation;
  if (mode == "stream") {
    at::Tensor x = at::ones({bytes / 4}, at::kFloat);
    for (uint32_t i = 0;; ++i) {
      tag.microbatch = i % 4096;
      (*t)->Send(0, tag, x)->Wait(absl::Seconds(60)).IgnoreError();
    }
  }
  if (mode == "burst") {
    // Sends `iters` tensors of `bytes` (filled with their index) and exits as soon as
    // each send has completed locally — before rank 0 has received them.
    for (uint32_t i = 0; i < iters; ++i) {
      tag.microbatch = i % 4096;
      if (!(*t)->Send(0, tag, at::full({bytes / 4}, static_cast<float>(i)))->Wait(absl::Seconds(60)).ok()) return 1;
    }
    return 0;
  }
  if (mode == "sink") {
    for (uint32_t round = 0;; ++round) {
      Tag t0 = tag;
      t0.step = round;
      t0.microbatch = 0;
      auto first = (*t)->Recv(0, t0);  // the round's size and count: (iters) then data
      if (!first->Wait(absl::Seconds(120)).ok() || first->Value().isNone()) return 0;
      const int64_t n = first->Value().toInt();
      // Keeps 16 receives posted, as ucx_perftest's receiver does.
      std::deque<std::shared_ptr<Work>> window;
      for (int64_t i = 1; i <= n; ++i) {
        Tag ti = t0;
        ti.microbatch = static_cast<uint32_t>(i % 4096);
        window.push_back((*t)->Recv(0, ti));
        if (window.size() >= 16 || i == n) {
          while (!window.empty() && (window.size() >= 16 || i == n)) {
            if (!window.front()->Wait(absl::Seconds(120)).ok()) return 1;
            window.pop_front();
          }
        }
      }
      (*t)->Send(0, t0, c10::IValue(int64_t{1}))->Wait(absl::Seconds(120)).IgnoreError();
    }
  }
  for (uint32_t i = 0; mode == "echo" || i < iters; ++i) {
    tag.microbatch = i % 4096;
    auto r = (*t)->Recv(0, tag);
    if (!r->Wait(absl::Seconds(60)).ok() || r->Value().isNone()) break;
    if (!(*t)->Send(0, tag, r->Value())->Wait(absl::Seconds(60)).ok()) break;
  }
  return 0;
}
