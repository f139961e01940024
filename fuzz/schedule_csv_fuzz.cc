// Fuzz target: the schedule CSV reader (pippyctl schedule --from-csv, torch's format).
// Any text is either refused with an error or read into a schedule that validates,
// simulates, and writes back to a CSV that reads to the same schedule.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pippy::schedule;
  auto s = FromCsv(std::string(reinterpret_cast<const char*>(data), size));
  if (!s.ok()) return 0;
  if (!Validate(*s).ok()) return 0;  // a deadlock is an error the tool reports
  auto sim = Simulate(*s);
  (void)sim;
  const std::string csv = ToCsv(*s);
  auto back = FromCsv(csv);
  if (!back.ok() || ToCsv(*back) != csv) std::abort();  // what it writes, it reads back
  return 0;
}
