#include "common/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pippy {

FileWriter::~FileWriter() {
  if (fd_ >= 0) close(fd_);
}

absl::Status FileWriter::Open(const std::string& path) {
  if (fd_ >= 0) close(fd_);
  path_ = path;
  written_ = started_ = 0;
  fd_ = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) return absl::UnavailableError(absl::StrCat("cannot write '", path, "': ", strerror(errno)));
  return absl::OkStatus();
}

absl::Status FileWriter::Append(absl::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is not open for writing"));
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("writing '", path_, "' failed: ", n < 0 ? strerror(errno) : "no progress", " (disk full?)"));
    }
    done += static_cast<size_t>(n);
    written_ += n;
  }
  while (written_ - started_ >= kWindow) {
    // Start this window's write-back; wait for the previous window's (already under
    // way, so this rarely blocks unless the disk is slower than the stream).
    sync_file_range(fd_, started_, kWindow, SYNC_FILE_RANGE_WRITE);
    if (started_ >= kWindow) {
      sync_file_range(fd_, started_ - kWindow, kWindow,
                      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    }
    started_ += kWindow;
  }
  return absl::OkStatus();
}

absl::Status FileWriter::Close(bool sync) {
  if (fd_ < 0) return absl::OkStatus();
  const bool synced = !sync || fsync(fd_) == 0;
  const int err = errno;
  const bool closed = close(fd_) == 0;
  fd_ = -1;
  if (!synced) return absl::UnavailableError(absl::StrCat("syncing '", path_, "' failed: ", strerror(err)));
  if (!closed) return absl::UnavailableError(absl::StrCat("closing '", path_, "' failed: ", strerror(errno)));
  return absl::OkStatus();
}

}  // namespace pippy
