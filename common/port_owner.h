// Who listens on a TCP port of this host: for "port in use" messages that name the
// process to stop or the port to choose instead.
#ifndef PIPPY_COMMON_PORT_OWNER_H_
#define PIPPY_COMMON_PORT_OWNER_H_

#include <string>

namespace pippy {

// "pid 1234 (pippy-coordinat)" for the process holding a listening TCP socket on
// `port` (IPv4 or IPv6), "another process" when the socket exists but its process is
// not visible to this one (another user's), "" when nothing listens there. Reads
// /proc/net/tcp{,6} and /proc/*/fd.
std::string PortOwner(int port);

}  // namespace pippy

#endif  // PIPPY_COMMON_PORT_OWNER_H_
