#!/bin/bash
# clang's -Wthread-safety over pippy's C++ (syntax only; its errors fail the test):
# every field annotated ABSL_GUARDED_BY is read and written only with its mutex held,
# and every ABSL_EXCLUSIVE_LOCKS_REQUIRED function is called with it. GCC builds the
# product; this test is where clang checks the annotations. Files are checked when
# they, or a header of pippy's they include (transitively), use a mutex or a lock
# annotation; the others are listed as skipped, with that reason.
set -u
CLANG=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$CLANG" ]; then
  echo "FAIL: clang++ is not installed (scripts/setup installs Debian's clang)"
  exit 1
fi
FLAGS=(-fsyntax-only -std=c++17 -Wthread-safety -Werror=thread-safety -Wno-unknown-warning-option
       -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -I. -isystem /usr/include/torch/csrc/api/include)
have_cuda=0
if [ -f /usr/local/cuda/include/nccl.h ]; then FLAGS+=(-isystem /usr/local/cuda/include); have_cuda=1; fi
OUT="${TEST_TMPDIR:-/tmp}/thread_safety"
rm -rf "$OUT" && mkdir -p "$OUT"

# Which files use locks, directly or through pippy's own headers.
mapfile -t plan < <(/usr/bin/python3 - "$have_cuda" <<'PY'
import os, re, sys
have_cuda = sys.argv[1] == "1"
include = re.compile(r'#include "([^"]+)"')
uses = re.compile(r'absl::Mutex|ABSL_GUARDED_BY|ABSL_EXCLUSIVE_LOCKS_REQUIRED|ABSL_LOCKS_EXCLUDED|std::mutex')
memo = {}
def locks(path, seen):
    if path in memo:
        return memo[path]
    if path in seen or not os.path.exists(path):
        return False
    seen.add(path)
    text = open(path, errors="replace").read()
    result = bool(uses.search(text)) or any(locks(inc, seen) for inc in include.findall(text))
    memo[path] = result
    return result
for root, _, files in os.walk("."):
    if root.startswith("./external"):
        continue
    for f in sorted(files):
        if not f.endswith(".cc"):
            continue
        path = os.path.join(root, f)[2:]
        if f == "nccl_transport.cc" and not have_cuda:
            print(f"skip {path} (no CUDA headers here)")
        elif locks(path, set()):
            print(f"check {path}")
        else:
            print(f"skip {path} (no mutex or lock annotation in it or its pippy headers)")
PY
)
files=()
for line in "${plan[@]}"; do
  case "$line" in
    check\ *) files+=("${line#check }") ;;
    *) echo "$line" ;;
  esac
done
export CLANG OUT
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} bash -c \
  '"$CLANG" "$@" {} > "$OUT/$(echo {} | tr / _).log" 2>&1' _ "${FLAGS[@]}"
failed=0
for f in "${files[@]}"; do
  log="$OUT/$(echo "$f" | tr / _).log"
  if grep -q "error:" "$log"; then
    echo "FAIL $f"
    grep -A3 "error:" "$log" | head -40
    failed=$((failed + 1))
  else
    echo "ok   $f"
  fi
done
echo "${#files[@]} files with locks checked by $($CLANG --version | head -1): $((${#files[@]} - failed)) passed, $failed failed"
[ "${#files[@]}" -gt 0 ] && [ "$failed" -eq 0 ]
