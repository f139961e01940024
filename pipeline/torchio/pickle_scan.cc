#include "pipeline/torchio/pickle_scan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace pippy::torchio {
namespace {

// One value (or mark) on the pickle machine's stack: how deep its containers nest,
// and whether it is a list, dict or set (or an object a REDUCE made, which may be one)
// that later opcodes may still fill.
struct Entry {
  bool mark = false;
  int depth = 1;
  bool mutable_container = false;
  size_t start = 0;  // where the opcodes that make it begin
};

bool AllowedGlobal(absl::string_view module, absl::string_view name) {
  if (module == "torch._utils") return name == "_rebuild_tensor_v2" || name == "_rebuild_parameter";
  if (module == "torch") return absl::EndsWith(name, "Storage") && name.size() < 32;
  if (module == "collections") return name == "OrderedDict";
  return false;
}

// Walks a pickle as the unpickler would, keeping for each value on the stack how deep it
// nests and where its opcodes begin. Strict (an untrusted pickle): ScanPickle's checks.
// Either way it notes each APPEND and SETITEM (which LibTorch 1.13's unpickler does not
// know) so that Rewrite() can turn them into MARK ... APPENDS / SETITEMS.
class Scanner {
 public:
  Scanner(absl::string_view p, const std::string& what, const PickleLimits& limits, bool strict)
      : p_(p), what_(what), limits_(limits), strict_(strict) {}

  // The pickle with single appends and setitems rewritten (the input itself if none).
  std::string Rewrite() const {
    if (marks_.empty()) return std::string(p_);
    std::string out;
    out.reserve(p_.size() + marks_.size());
    size_t m = 0;
    std::vector<size_t> marks = marks_;
    std::sort(marks.begin(), marks.end());
    for (size_t i = 0; i < p_.size(); ++i) {
      while (m < marks.size() && marks[m] == i) {
        out.push_back('(');
        ++m;
      }
      auto r = replaced_.find(i);
      out.push_back(r != replaced_.end() ? r->second : p_[i]);
    }
    return out;
  }
  bool rewritable() const { return !saw_frame_; }

  absl::Status Run() {
    if (strict_ && p_.size() > limits_.max_bytes) {
      return Bad(absl::StrCat("its pickle is ", p_.size(), " bytes; at most ", limits_.max_bytes,
                              " are accepted (the tensors' bytes do not count: a request holds a few tensors, "
                              "or tuples, lists and dicts of them)"));
    }
    while (pos_ < p_.size()) {
      at_ = pos_;
      const uint8_t op = static_cast<uint8_t>(p_[pos_++]);
      absl::Status s = Step(op);
      if (!s.ok()) return s;
      if (stopped_) break;
    }
    if (!stopped_) return Bad("the pickle ends without its STOP opcode (truncated?)");
    if (stack_.size() != 1 || stack_[0].mark) return Bad("the pickle does not leave exactly one value");
    return absl::OkStatus();
  }

 private:
  absl::Status Bad(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(what_, ": not a torch.save file of tensors: ", what,
                                                   " (at byte ", at_, " of its pickle)"));
  }

  absl::Status Need(size_t n) {
    if (p_.size() - pos_ < n) return Bad("the pickle ends inside an opcode's argument (truncated?)");
    return absl::OkStatus();
  }
  uint64_t ReadLE(size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }
  // A length-prefixed argument: the length must lie within what follows.
  absl::Status Skip(size_t width) {
    absl::Status s = Need(width);
    if (!s.ok()) return s;
    const uint64_t len = ReadLE(width);
    if (len > p_.size() - pos_) {
      return Bad(absl::StrCat("an argument announces ", len, " bytes but only ", p_.size() - pos_, " follow"));
    }
    pos_ += static_cast<size_t>(len);
    return absl::OkStatus();
  }
  absl::StatusOr<absl::string_view> Line() {
    const size_t end = p_.find('\n', pos_);
    if (end == absl::string_view::npos || end - pos_ > 256) return Bad("a text argument without its end of line");
    absl::string_view line = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }

  absl::Status Push(Entry e) {
    if (strict_ && e.depth > limits_.max_depth) {
      return Bad(absl::StrCat("values nest more than ", limits_.max_depth, " levels deep"));
    }
    if (stack_.size() >= 1000000) return Bad("too many values on the stack");
    stack_.push_back(e);
    return absl::OkStatus();
  }
  absl::StatusOr<Entry> Pop() {
    if (stack_.empty() || stack_.back().mark) return Bad("an opcode takes a value that is not there");
    Entry e = stack_.back();
    stack_.pop_back();
    return e;
  }
  // Pops the values above the topmost mark and the mark; returns their deepest depth.
  absl::StatusOr<int> PopToMark(size_t* mark_start = nullptr) {
    int deepest = 0;
    while (!stack_.empty() && !stack_.back().mark) {
      deepest = std::max(deepest, stack_.back().depth);
      stack_.pop_back();
    }
    if (stack_.empty()) return Bad("an opcode needs a MARK that is not there");
    if (mark_start != nullptr) *mark_start = stack_.back().start;
    stack_.pop_back();
    return deepest;
  }
  // The container on top receives values of depth `child`.
  absl::Status Fill(int child) {
    if (stack_.empty() || stack_.back().mark) return Bad("values are added to a container that is not there");
    Entry& c = stack_.back();
    c.depth = std::max(c.depth, child + 1);
    if (strict_ && c.depth > limits_.max_depth) return Bad(absl::StrCat("values nest more than ", limits_.max_depth, " levels deep"));
    return absl::OkStatus();
  }
  absl::Status Memoize(uint64_t key) {
    if (stack_.empty() || stack_.back().mark) return Bad("memoizes a value that is not there");
    // The unpickler sizes its memo table by the largest index (found by request_fuzz:
    // one LONG_BINPUT of 3 billion made it allocate 24 GB); Python numbers them 0, 1, ...
    if (strict_ && key > memo_.size()) {
      return Bad(absl::StrCat("memo index ", key, " skips past the ", memo_.size(), " stored so far"));
    }
    if (memo_.size() >= 1000000) return Bad("too many memoized values");
    memo_[key] = stack_.back();
    return absl::OkStatus();
  }
  absl::Status Fetch(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return Bad(absl::StrCat("refers to memo entry ", key, ", which was never stored"));
    if (strict_ && it->second.mutable_container) {
      return Bad("refers to the same list, dict or object twice (or to one inside itself); send separate copies");
    }
    Entry e = it->second;
    e.start = at_;
    return Push(e);
  }
  Entry Leaf() const { return Entry{false, 1, false, at_}; }

  absl::Status Step(uint8_t op) {
#define PIPPY_TRY(expr)                        \
  do {                                         \
    absl::Status pippy_s = (expr);             \
    if (!pippy_s.ok()) return pippy_s;         \
  } while (0)
#define PIPPY_TRY_ASSIGN(lhs, expr)            \
  auto lhs##_or = (expr);                      \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *lhs##_or
    switch (op) {
      case 0x80:  // PROTO
        PIPPY_TRY(Need(1));
        if (ReadLE(1) > 4) return Bad("a pickle protocol above 4");
        return absl::OkStatus();
      case 0x95:  // FRAME: a length within the rest
        saw_frame_ = true;
        PIPPY_TRY(Need(8));
        if (ReadLE(8) > p_.size() - pos_) return Bad("a frame longer than the pickle");
        return absl::OkStatus();
      case '.':  // STOP
        stopped_ = true;
        return absl::OkStatus();
      case '(':  // MARK
        return Push(Entry{true, 0, false, at_});
      case 'N': case 0x88: case 0x89: case ')':  // NONE, NEWTRUE, NEWFALSE, EMPTY_TUPLE
        return Push(Leaf());
      case 'K':  // BININT1
        PIPPY_TRY(Need(1));
        pos_ += 1;
        return Push(Leaf());
      case 'M':  // BININT2
        PIPPY_TRY(Need(2));
        pos_ += 2;
        return Push(Leaf());
      case 'J':  // BININT
        PIPPY_TRY(Need(4));
        pos_ += 4;
        return Push(Leaf());
      case 'G':  // BINFLOAT
        PIPPY_TRY(Need(8));
        pos_ += 8;
        return Push(Leaf());
      case 0x8a: {  // LONG1: up to 8 bytes (what an int64 holds)
        PIPPY_TRY(Need(1));
        const uint64_t n = ReadLE(1);
        if (n > 8) return Bad("an integer wider than 64 bits");
        PIPPY_TRY(Need(n));
        pos_ += n;
        return Push(Leaf());
      }
      case 'U': case 0x8c: case 'C':  // SHORT_BINSTRING, SHORT_BINUNICODE, SHORT_BINBYTES
        PIPPY_TRY(Skip(1));
        return Push(Leaf());
      case 'T': case 'X': case 'B':  // BINSTRING, BINUNICODE, BINBYTES
        PIPPY_TRY(Skip(4));
        return Push(Leaf());
      case 0x8d: case 0x8e:  // BINUNICODE8, BINBYTES8
        PIPPY_TRY(Skip(8));
        return Push(Leaf());
      case 'I': case 'L': case 'F': case 'S': case 'V': {  // INT, LONG, FLOAT, STRING, UNICODE
        PIPPY_TRY_ASSIGN(line, Line());
        (void)line;
        return Push(Leaf());
      }
      case 'c': {  // GLOBAL module\nname\n
        PIPPY_TRY_ASSIGN(module, Line());
        PIPPY_TRY_ASSIGN(name, Line());
        if (strict_ && !AllowedGlobal(module, name)) {
          return Bad(absl::StrCat("it names '", module, ".", name,
                                  "', which torch.save writes for no tensor or container"));
        }
        return Push(Leaf());
      }
      case 'Q': {  // BINPERSID: a storage's id
        PIPPY_TRY_ASSIGN(id, Pop());
        return Push(Entry{false, id.depth + 1, false, id.start});
      }
      case 't': case 'l': case 'd': {  // TUPLE, LIST, DICT
        size_t start = 0;
        PIPPY_TRY_ASSIGN(deepest, PopToMark(&start));
        return Push(Entry{false, deepest + 1, op != 't', start});
      }
      case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
        int deepest = 0;
        size_t start = 0;
        for (int i = 0; i < op - 0x84; ++i) {
          PIPPY_TRY_ASSIGN(e, Pop());
          deepest = std::max(deepest, e.depth);
          start = e.start;  // the first element's
        }
        return Push(Entry{false, deepest + 1, false, start});
      }
      case ']': case '}':  // EMPTY_LIST, EMPTY_DICT
        return Push(Entry{false, 1, true, at_});
      case 'a': {  // APPEND = MARK before the value, APPENDS
        PIPPY_TRY_ASSIGN(v, Pop());
        marks_.push_back(v.start);
        replaced_[at_] = 'e';
        return Fill(v.depth);
      }
      case 's': {  // SETITEM = MARK before the key, SETITEMS
        PIPPY_TRY_ASSIGN(v, Pop());
        PIPPY_TRY_ASSIGN(k, Pop());
        marks_.push_back(k.start);
        replaced_[at_] = 'u';
        return Fill(std::max(v.depth, k.depth));
      }
      case 'e': case 'u': {  // APPENDS, SETITEMS
        PIPPY_TRY_ASSIGN(deepest, PopToMark());
        return Fill(deepest);
      }
      case 'b': {  // BUILD
        PIPPY_TRY_ASSIGN(state, Pop());
        return Fill(state.depth);
      }
      case 'R': case 0x81: {  // REDUCE, NEWOBJ: callable (class) and its arguments
        PIPPY_TRY_ASSIGN(args, Pop());
        PIPPY_TRY_ASSIGN(callable, Pop());
        return Push(Entry{false, std::max(args.depth, callable.depth) + 1, true, callable.start});
      }
      case '0': {  // POP
        if (stack_.empty()) return Bad("POP of an empty stack");
        stack_.pop_back();
        return absl::OkStatus();
      }
      case '1': {  // POP_MARK
        PIPPY_TRY_ASSIGN(unused, PopToMark());
        (void)unused;
        return absl::OkStatus();
      }
      case 'q':  // BINPUT
        PIPPY_TRY(Need(1));
        return Memoize(ReadLE(1));
      case 'r':  // LONG_BINPUT
        PIPPY_TRY(Need(4));
        return Memoize(ReadLE(4));
      case 0x94:  // MEMOIZE
        return Memoize(memo_.size());
      case 'h':  // BINGET
        PIPPY_TRY(Need(1));
        return Fetch(ReadLE(1));
      case 'j':  // LONG_BINGET
        PIPPY_TRY(Need(4));
        return Fetch(ReadLE(4));
      default:
        return Bad(absl::StrCat("opcode 0x", absl::Hex(op), ", which torch.save does not write for tensors"));
    }
#undef PIPPY_TRY
#undef PIPPY_TRY_ASSIGN
  }

  absl::string_view p_;
  const std::string& what_;
  const PickleLimits limits_;
  const bool strict_;
  bool saw_frame_ = false;
  std::vector<size_t> marks_;              // MARKs to insert before these offsets
  std::map<size_t, char> replaced_;        // APPEND -> APPENDS, SETITEM -> SETITEMS
  size_t pos_ = 0;
  size_t at_ = 0;
  bool stopped_ = false;
  std::vector<Entry> stack_;
  std::unordered_map<uint64_t, Entry> memo_;
};

}  // namespace

absl::Status ScanPickle(absl::string_view pickle, const std::string& what, const PickleLimits& limits) {
  return Scanner(pickle, what, limits, /*strict=*/true).Run();
}

absl::StatusOr<std::string> PickleForLibTorch(absl::string_view pickle, const std::string& what,
                                              const PickleLimits* limits) {
  Scanner scanner(pickle, what, limits != nullptr ? *limits : PickleLimits{}, /*strict=*/limits != nullptr);
  absl::Status s = scanner.Run();
  if (!s.ok()) {
    if (limits != nullptr) return s;
    return std::string(pickle);  // trusted: what the scan does not know, LibTorch may
  }
  if (!scanner.rewritable()) return std::string(pickle);
  return scanner.Rewrite();
}

}  // namespace pippy::torchio
