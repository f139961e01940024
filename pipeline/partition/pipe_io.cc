#include "pipeline/partition/pipe_io.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "google/protobuf/util/json_util.h"

namespace pippy::partition {

std::string PlanToJson(const PipelinePlan& plan) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(plan, &json, opts);
  return json;
}

absl::Status WritePipe(const Pipe& pipe, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create output folder '", dir, "': ", ec.message()));
  }
  for (size_t s = 0; s < pipe.stages.size(); ++s) {
    std::string path = absl::StrCat(dir, "/stage_", s, ".pt");
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("writing '", path, "'"),
                                    [&] { pipe.stages[s].save(path); }, absl::StatusCode::kInternal));
  }
  std::string path = absl::StrCat(dir, "/plan.json");
  std::ofstream out(path);
  out << PlanToJson(pipe.plan);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

}  // namespace pippy::partition
