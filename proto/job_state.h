// Job states as the API defines them (coordinator.proto), decided once: which are
// terminal is an option on the enum values, read here by the coordinator, its gRPC
// layer and pippyctl (and from the descriptors by the Python client).
#ifndef PIPPY_PROTO_JOB_STATE_H_
#define PIPPY_PROTO_JOB_STATE_H_

#include "proto/coordinator.pb.h"

namespace pippy {

// Whether a job in `state` has ended (SUCCEEDED, FAILED, CANCELLED): nothing changes
// it any more.
bool IsTerminal(JobState state);

}  // namespace pippy

#endif  // PIPPY_PROTO_JOB_STATE_H_
