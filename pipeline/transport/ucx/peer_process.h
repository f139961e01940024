// Tests and benchmarks of UCX across real processes: `ucx_peer` (rank 1) started as a
// child with pipes for stdin/stdout, and the handshake it speaks — it prints
// "ADDRESS <hex>" and reads rank 0's address as one hex line.
#ifndef PIPPY_PIPELINE_TRANSPORT_UCX_PEER_PROCESS_H_
#define PIPPY_PIPELINE_TRANSPORT_UCX_PEER_PROCESS_H_

#include <sys/types.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipeline/transport/ucx/ucx_transport.h"

namespace pippy::transport::ucx {

// Settings for UCX_TLS `tls` on this host: the transports, and the loopback NIC for tcp.
Options LocalOptions(const std::string& tls);

class PeerProcess {
 public:
  // Starts argv (argv[0] a path). pid() is -1 when it could not start.
  explicit PeerProcess(const std::vector<std::string>& argv);
  // Stops the child by its pid (SIGKILL) and reaps it.
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  pid_t pid() const { return pid_; }
  void Kill();
  // Waits up to `timeout` for the child to exit by itself: its exit code, or -1 (still
  // running, or killed by a signal).
  int WaitExit(absl::Duration timeout);

  // Creates rank 0 of 2 and connects it to the child (rank 1): reads the child's address
  // (skipping whatever UCX prints), sends this one's, then Connect().
  absl::StatusOr<std::unique_ptr<UcxTransport>> Connect(const Options& options);

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

}  // namespace pippy::transport::ucx

#endif  // PIPPY_PIPELINE_TRANSPORT_UCX_PEER_PROCESS_H_
