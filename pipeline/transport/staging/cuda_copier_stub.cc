// NewCudaCopier where pippy is built without CUDA.
#include "absl/strings/str_cat.h"
#include "pipeline/transport/staging/device_copier.h"

namespace pippy::transport::staging {

absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCudaCopier(int device) {
  return absl::UnimplementedError(absl::StrCat("cuda:", device,
                                               ": this build of pippy has no CUDA (build where CUDA and NCCL are found)"));
}

}  // namespace pippy::transport::staging
