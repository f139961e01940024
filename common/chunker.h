// Cuts a stream of pieces (a file being read, an archive being written) into chunks of
// a fixed size for messages, and says which chunk is the last: every file pippy moves
// over gRPC goes through one.
//
// Thread safety: none (one writer).
#ifndef PIPPY_COMMON_CHUNKER_H_
#define PIPPY_COMMON_CHUNKER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pippy {

class Chunker {
 public:
  // `emit(chunk, last)` sends one chunk; its error stops the stream and is returned.
  using Emit = std::function<absl::Status(std::string chunk, bool last)>;
  Chunker(size_t chunk_bytes, Emit emit) : chunk_bytes_(chunk_bytes), emit_(std::move(emit)) {}

  // Appends a piece; emits every chunk it completes.
  absl::Status Append(absl::string_view piece) {
    total_ += piece.size();
    while (!piece.empty()) {
      const size_t take = std::min(piece.size(), chunk_bytes_ - pending_.size());
      pending_.append(piece.data(), take);
      piece.remove_prefix(take);
      if (pending_.size() == chunk_bytes_) {
        absl::Status s = emit_(std::exchange(pending_, std::string()), false);
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  // Emits what is pending (possibly nothing) as the last chunk.
  absl::Status Finish() { return emit_(std::exchange(pending_, std::string()), true); }

  // Bytes appended so far.
  size_t total() const { return total_; }

  using Sink = std::function<absl::Status(absl::string_view)>;
  // Streams everything `source` writes (through the sink it is given) as chunks of
  // `chunk_bytes` to `emit`, the last one when `source` returns. Returns the bytes
  // streamed, or the first error of `source` or `emit` (nothing more is emitted then).
  static absl::StatusOr<int64_t> Stream(size_t chunk_bytes, Emit emit,
                                        const std::function<absl::Status(const Sink&)>& source) {
    Chunker chunker(chunk_bytes, std::move(emit));
    absl::Status s = source([&](absl::string_view piece) { return chunker.Append(piece); });
    if (s.ok()) s = chunker.Finish();
    if (!s.ok()) return s;
    return static_cast<int64_t>(chunker.total());
  }

 private:
  const size_t chunk_bytes_;
  const Emit emit_;
  std::string pending_;
  size_t total_ = 0;
};

}  // namespace pippy

#endif  // PIPPY_COMMON_CHUNKER_H_
