// The gRPC adapter: the Coordinator and WorkerHub services, translating between
// gRPC and the service logic (coordinator.h). No decisions are made here.
#ifndef PIPPY_COORDINATOR_GRPC_SERVICE_H_
#define PIPPY_COORDINATOR_GRPC_SERVICE_H_

#include <atomic>
#include <memory>

#include "absl/time/time.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "proto/coordinator.grpc.pb.h"

namespace pippy::coordinator {

grpc::Status ToGrpc(const absl::Status& s);

// Limits on what one call may bring (0: none). Exceeding one is RESOURCE_EXHAUSTED
// naming the flag that raises it.
struct Limits {
  int64_t max_model_bytes = 0;     // --max-model-mib
  int64_t max_data_bytes = 0;      // --max-data-mib
  int64_t max_dataset_bytes = 0;   // --max-dataset-upload-gib: an uploaded dataset's shards together
  int max_concurrent_streams = 0;  // --max-concurrent-streams: SubmitJob and FetchModel at once
  // --stream-idle-timeout-s: an upload (SubmitJob) that sends nothing, or a download
  // (FetchModel) whose client reads nothing, for this long is cancelled and its stream
  // slot freed (DEADLINE_EXCEEDED, logged with the peer). Zero: no limit.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
};

class CoordinatorGrpc final : public pippy::Coordinator::Service {
 public:
  // auth: user tokens (--auth-token-file); nullptr: every call is anonymous.
  explicit CoordinatorGrpc(Coordinator* logic, const TokenAuth* auth = nullptr, Limits limits = {})
      : logic_(logic), auth_(auth), limits_(limits) {}
  grpc::Status SubmitJob(grpc::ServerContext* context, grpc::ServerReader<SubmitJobRequest>* reader,
                         SubmitJobResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const GetJobRequest* request, Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const ListJobsRequest*, ListJobsResponse* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                        grpc::ServerWriter<ProgressEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const CancelJobRequest* request, Job* response) override;
  grpc::Status DeleteJob(grpc::ServerContext* context, const DeleteJobRequest* request,
                         DeleteJobResponse* response) override;
  grpc::Status FetchModel(grpc::ServerContext* context, const FetchModelRequest* request,
                          grpc::ServerWriter<ModelChunk>* writer) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const ListWorkersRequest*, ListWorkersResponse* response) override;
  grpc::Status GetTrace(grpc::ServerContext* context, const GetTraceRequest* request, StepTrace* response) override;
  // Serving: the handler waits for the answer (or the client's cancel or deadline).
  grpc::Status Infer(grpc::ServerContext* context, const InferRequest* request, InferResponse* response) override;
  // Requests are read as they come; answers are written by a writer thread of the call
  // as they complete (so a slow reader never holds up the pipeline's results).
  grpc::Status InferStream(grpc::ServerContext* context,
                           grpc::ServerReaderWriter<InferResponse, InferRequest>* stream) override;
  grpc::Status Generate(grpc::ServerContext* context, const GenerateRequest* request,
                        grpc::ServerWriter<GenerateResponse>* writer) override;

 private:
  // The caller's user ("" without auth). Errors: UNAUTHENTICATED, logged with the
  // peer's address (never the token).
  absl::StatusOr<std::string> Authenticate(grpc::ServerContext* context) const;
  // Takes one of --max-concurrent-streams (or refuses); the returned guard gives it back.
  absl::StatusOr<std::shared_ptr<void>> TakeStream(const char* what);
  Coordinator* logic_;
  const TokenAuth* auth_;
  const Limits limits_;
  std::atomic<int> streams_{0};
};

class WorkerHubGrpc final : public pippy::WorkerHub::Service {
 public:
  // require_client_cert: workers must present a certificate the server's TLS verified
  // (--tls-client-ca); others are refused with UNAUTHENTICATED.
  explicit WorkerHubGrpc(Coordinator* logic, bool require_client_cert = false)
      : logic_(logic), require_client_cert_(require_client_cert) {}
  grpc::Status Connect(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<CoordinatorMessage, WorkerMessage>* stream) override;

 private:
  Coordinator* logic_;
  bool require_client_cert_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_GRPC_SERVICE_H_
