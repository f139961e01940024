// The gRPC adapter: the Coordinator and WorkerHub services, translating between
// gRPC and the service logic (coordinator.h). No decisions are made here.
#ifndef PIPPY_COORDINATOR_GRPC_SERVICE_H_
#define PIPPY_COORDINATOR_GRPC_SERVICE_H_

#include "coordinator/coordinator.h"
#include "proto/coordinator.grpc.pb.h"

namespace pippy::coordinator {

grpc::Status ToGrpc(const absl::Status& s);

class CoordinatorGrpc final : public pippy::Coordinator::Service {
 public:
  explicit CoordinatorGrpc(Coordinator* logic) : logic_(logic) {}
  grpc::Status SubmitJob(grpc::ServerContext*, grpc::ServerReader<SubmitJobRequest>* reader,
                         SubmitJobResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext*, const GetJobRequest* request, Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext*, const ListJobsRequest*, ListJobsResponse* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                        grpc::ServerWriter<ProgressEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext*, const CancelJobRequest* request, Job* response) override;
  grpc::Status FetchModel(grpc::ServerContext*, const FetchModelRequest* request,
                          grpc::ServerWriter<ModelChunk>* writer) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const ListWorkersRequest*, ListWorkersResponse* response) override;
  grpc::Status GetTrace(grpc::ServerContext*, const GetTraceRequest* request, StepTrace* response) override;

 private:
  Coordinator* logic_;
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
