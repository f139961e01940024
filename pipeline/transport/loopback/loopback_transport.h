// In-process transport: N ranks as threads of one process, for unit tests of the
// stage runtime. Sent tensors are deep-copied, as a real transfer would, so that no
// test passes by sharing memory between ranks.
//
// Thread safety: all methods may be called from any thread.
#ifndef PIPPY_PIPELINE_TRANSPORT_LOOPBACK_LOOPBACK_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_LOOPBACK_LOOPBACK_TRANSPORT_H_

#include <memory>
#include <vector>

#include "pipeline/transport/transport.h"

namespace pippy::transport::loopback {

class LoopbackGroup;

// Creates `world_size` connected transports (index = rank). The group lives as long
// as any of them.
std::vector<std::unique_ptr<Transport>> Create(int world_size);

// Makes `rank` vanish: its pending and future operations, and those of its peers
// with it, fail with UNAVAILABLE (a stand-in for a dead process in unit tests).
void KillRank(Transport* any_member, int rank);

}  // namespace pippy::transport::loopback

#endif  // PIPPY_PIPELINE_TRANSPORT_LOOPBACK_LOOPBACK_TRANSPORT_H_
