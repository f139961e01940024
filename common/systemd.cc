#include "common/systemd.h"

#include <systemd/sd-daemon.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pippy::systemd {

void NotifyReady(const std::string& status) {
  sd_notify(0, absl::StrCat("READY=1\nSTATUS=", status).c_str());
}

void NotifyStatus(const std::string& status) { sd_notify(0, absl::StrCat("STATUS=", status).c_str()); }

void NotifyStopping() { sd_notify(0, "STOPPING=1"); }

bool StartWatchdog(std::function<bool()> healthy) {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return false;
  const auto every = std::chrono::microseconds(usec / 2);
  log::Info("systemd watchdog: pinging every {} ms", usec / 2000);
  std::thread([every, healthy] {
    while (true) {
      if (!healthy || healthy()) sd_notify(0, "WATCHDOG=1");
      std::this_thread::sleep_for(every);
    }
  }).detach();
  return true;
}

}  // namespace pippy::systemd
