#include "proto/job_state.h"

#include "proto/options.pb.h"

namespace pippy {

bool IsTerminal(JobState state) {
  const google::protobuf::EnumValueDescriptor* v = JobState_descriptor()->FindValueByNumber(state);
  return v != nullptr && v->options().GetExtension(terminal);
}

}  // namespace pippy
