// Work the coordinator must not do in its own process, run in a child of the same
// binary with deadlines and a memory cap.
//
// Preparing a submission loads LibTorch's deserializer and TorchScript compiler on an
// archive someone uploaded (not hardened: fuzz/model_fuzz found archives that crash
// them) and runs the model's own `forward` (shapes, the loss check, --balance time):
// user code, which may never return or allocate without bound. Merging trained stages
// back into the model loads archives the workers sent. Each runs in a child process
// (job_preparation.h says which); this file is the parent's and the child's halves of
// that arrangement, with no LibTorch in it.
//
// The child announces phases on its stdout ("[pippy-phase NAME]" lines); the parent
// bounds each announced phase that has a limit of its own (the forward probe) as well as
// the whole child, kills the child when either runs out or when `cancelled` turns true
// (the coordinator stopping), and reports how the child ended, in which phase, and what
// it printed. The child dies with its parent (PR_SET_PDEATHSIG).
//
// Thread safety: RunChild may run on several threads at once (one child each).
#ifndef PIPPY_COORDINATOR_CHILD_PROCESS_H_
#define PIPPY_COORDINATOR_CHILD_PROCESS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace pippy::coordinator {

struct ChildSpec {
  std::vector<std::string> argv;  // argv[0] is the binary
  absl::Duration timeout = absl::Minutes(5);  // the whole child
  // Phases bounded on their own (by the name the child announces).
  std::map<std::string, absl::Duration> phase_timeouts;
  // Polled every 100 ms while the child runs: true kills it (kCancelled).
  std::function<bool()> cancelled;
};

struct ChildResult {
  enum class Ending { kExited, kSignalled, kTimedOut, kPhaseTimedOut, kCancelled, kNotStarted };
  Ending ending = Ending::kNotStarted;
  int exit_code = -1;  // kExited
  int signal = 0;      // kSignalled
  std::string phase;   // the last phase announced ("" before the first)
  absl::Duration limit;  // kTimedOut, kPhaseTimedOut: the limit that ran out
  std::string said;    // stdout without the phase lines (at most 64 KiB), trimmed
  std::string start_error;  // kNotStarted
  // The child's error line ("[pippy-error CODE]" then its message; see ReportError).
  bool has_error = false;
  absl::Status error;
  int64_t peak_rss_bytes = 0;  // the child's own figure ("[pippy-peak N]"), 0 if not said
};

// Starts `spec.argv` and waits for it to end (within the limits).
ChildResult RunChild(const ChildSpec& spec);

// The endings every caller words alike, as a status: OK for exit 0, the child's own
// reported error, UNAVAILABLE when it could not start, was cancelled (the coordinator
// stopping) or exited without saying why (`doing`: "preparing the submission").
// nullopt for deadlines and signals, which the caller words for its phases.
std::optional<absl::Status> PlainEnding(const ChildResult& result, absl::string_view doing);

// ---- the child's side ----
// The heap a child that loads files of `file_bytes` in all may use: LibTorch itself
// with room to spare, plus the files a few times over (a model, its stages' graphs,
// the data). kChildHeapFactor is named in messages.
inline constexpr uint64_t kChildHeapBase = uint64_t{2} << 30;
inline constexpr uint64_t kChildHeapFactor = 4;
inline uint64_t ChildHeapCap(uint64_t file_bytes) { return kChildHeapBase + kChildHeapFactor * file_bytes; }

// Dies with the parent; caps the heap (RLIMIT_DATA: brk and private writable mappings,
// so LibTorch's allocations) at `heap_bytes` (0: no cap); stdout unbuffered by lines.
void EnterChild(uint64_t heap_bytes);
// Says which phase the child is in (the parent's deadlines and messages use it).
void AnnouncePhase(absl::string_view phase);
// Prints the status for the parent (RunChild fills ChildResult::error with it).
void ReportError(const absl::Status& status);
// Prints the child's peak resident memory (VmHWM) for the parent.
void ReportPeak();

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_CHILD_PROCESS_H_
