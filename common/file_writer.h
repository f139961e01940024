#pragma once

// A file written front to back from a stream (an upload, a checkpoint) that must be on
// disk when it is closed. The write-back starts while the stream is still arriving:
// every kWindow bytes the kernel is asked to start writing the window just filled, and
// the one before it is waited for, so at most two windows are dirty at any time and
// Close()'s fsync has at most those left to write. A plain write + fsync would leave the
// whole file dirty in the page cache and pay its write-back after the last byte, on top
// of the transfer; this overlaps them (upload time ~ max(network, disk), not the sum).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pippy {

class FileWriter {
 public:
  static constexpr int64_t kWindow = 32LL << 20;

  FileWriter() = default;
  ~FileWriter();  // closes without syncing
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Creates or truncates `path`. Errors: UNAVAILABLE naming the file.
  absl::Status Open(const std::string& path);
  bool is_open() const { return fd_ >= 0; }
  // Errors: UNAVAILABLE naming the file (disk full, I/O error).
  absl::Status Append(absl::string_view bytes);
  // fsyncs (when `sync`) and closes. Errors: UNAVAILABLE naming the file.
  absl::Status Close(bool sync = true);
  int64_t bytes() const { return written_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t written_ = 0;
  int64_t started_ = 0;  // bytes whose write-back has been started
};

}  // namespace pippy
