// Message bounds shared by the daemons.
#ifndef PIPPY_COMMON_GRPC_LIMITS_H_
#define PIPPY_COMMON_GRPC_LIMITS_H_

#include <cstdint>

namespace pippy {

// The largest gRPC message a worker accepts from the coordinator (its channel's max
// receive size): what the coordinator sends one message at a time (a serving
// micro-batch's inputs) stays within it.
inline constexpr int64_t kWorkerMaxMessageBytes = int64_t{64} << 20;

}  // namespace pippy

#endif  // PIPPY_COMMON_GRPC_LIMITS_H_
