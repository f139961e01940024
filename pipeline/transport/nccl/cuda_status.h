// CUDA's and NCCL's errors as absl::Status, once, for the NCCL backend's files.
#ifndef PIPPY_PIPELINE_TRANSPORT_NCCL_CUDA_STATUS_H_
#define PIPPY_PIPELINE_TRANSPORT_NCCL_CUDA_STATUS_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pippy::transport::nccl {

inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

inline absl::Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace pippy::transport::nccl

#endif  // PIPPY_PIPELINE_TRANSPORT_NCCL_CUDA_STATUS_H_
