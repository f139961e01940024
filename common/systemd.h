// systemd's service protocol (libsystemd's sd_notify): a daemon started with
// Type=notify says READY=1 once it serves, STOPPING=1 when it stops, and pings the
// watchdog (WatchdogSec=) while it is alive. Outside systemd (no NOTIFY_SOCKET) every
// call does nothing.
#ifndef PIPPY_COMMON_SYSTEMD_H_
#define PIPPY_COMMON_SYSTEMD_H_

#include <functional>
#include <string>

namespace pippy::systemd {

// READY=1 with a STATUS= line for `systemctl status`. Safe to call more than once.
void NotifyReady(const std::string& status);
// STATUS= alone (e.g. "reconnecting to the coordinator").
void NotifyStatus(const std::string& status);
void NotifyStopping();
// When the service manager asked for a watchdog (WATCHDOG_USEC), pings WATCHDOG=1 at
// half its interval from a thread of its own for as long as the process lives.
// Returns whether it started one.
// `healthy` (if given) is asked before each ping: no ping while it says false, so
// systemd restarts a daemon whose own loop is stuck.
bool StartWatchdog(std::function<bool()> healthy = nullptr);

}  // namespace pippy::systemd

#endif  // PIPPY_COMMON_SYSTEMD_H_
