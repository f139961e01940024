// A check of a pickle (the data.pkl of a torch.save file) from an untrusted client,
// before LibTorch's unpickler sees it.
//
// LibTorch 1.13's unpickler trusts what a pickle announces: a string of 4 GiB is
// allocated (and zero-filled) before its bytes are found missing, a type tag goes to a
// type parser that can crash on a malformed one, and a value nested a few hundred
// thousand levels deep (or a list that holds itself) is later destroyed, printed or
// walked by recursion that overflows the stack. Data files are loaded in a child
// process first (coordinator/job_preparation.h); serving requests come too often for that,
// so their pickles are walked here first, opcode by opcode, without allocating what
// they announce: lengths must lie within the bytes that follow, only the globals that
// torch.save writes for tensors and containers may be named, nesting is bounded, and
// a list or dict may not be referred to twice (the only way to make a cycle).
#ifndef PIPPY_PIPELINE_TORCHIO_PICKLE_SCAN_H_
#define PIPPY_PIPELINE_TORCHIO_PICKLE_SCAN_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pippy::torchio {

struct PickleLimits {
  size_t max_bytes = 64 * 1024;  // the pickle itself; tensors' bytes are separate records
  int max_depth = 32;            // containers within containers
};

// OK when `pickle` is one complete pickle (protocol <= 4) of None, bools, ints, floats,
// strings, tuples, lists, dicts and tensors as torch.save writes them, within `limits`.
// Errors: INVALID_ARGUMENT starting with `what` and saying what was found where.
absl::Status ScanPickle(absl::string_view pickle, const std::string& what, const PickleLimits& limits = {});

// The pickle as LibTorch 1.13's unpickler reads it: that unpickler knows APPENDS and
// SETITEMS but not APPEND and SETITEM, which Python's pickler writes for a list or dict
// of one item (torch.save([x]), torch.save({"inputs": x})); each is rewritten as MARK
// before its item and APPENDS / SETITEMS. With `limits` (untrusted), ScanPickle's
// checks first (its errors); without, a pickle the walk does not follow is returned
// as it is, for LibTorch to judge.
absl::StatusOr<std::string> PickleForLibTorch(absl::string_view pickle, const std::string& what,
                                              const PickleLimits* limits);

}  // namespace pippy::torchio

#endif  // PIPPY_PIPELINE_TORCHIO_PICKLE_SCAN_H_
