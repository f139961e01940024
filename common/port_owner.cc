#include "common/port_owner.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace pippy {
namespace {

// The inodes of the sockets listening on `port` in /proc/net/tcp-like `path`.
void ListeningInodes(const std::string& path, int port, std::set<std::string>* inodes) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
    if (!(f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode)) continue;
    if (state != "0A") continue;  // TCP_LISTEN
    const size_t colon = local.rfind(':');
    if (colon == std::string::npos) continue;
    if (std::strtol(local.c_str() + colon + 1, nullptr, 16) == port) inodes->insert(inode);
  }
}

}  // namespace

std::string PortOwner(int port) {
  std::set<std::string> inodes;
  ListeningInodes("/proc/net/tcp", port, &inodes);
  ListeningInodes("/proc/net/tcp6", port, &inodes);
  if (inodes.empty()) return "";
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return "another process";
  std::string owner;
  const pid_t self = getpid();
  while (dirent* e = readdir(proc)) {
    const std::string pid = e->d_name;
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos || std::atoi(pid.c_str()) == self) {
      continue;
    }
    const std::string fd_dir = "/proc/" + pid + "/fd";
    DIR* fds = opendir(fd_dir.c_str());
    if (fds == nullptr) continue;  // another user's
    while (dirent* fd = readdir(fds)) {
      char target[256];
      const ssize_t n = readlink((fd_dir + "/" + fd->d_name).c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      const std::string t(target, static_cast<size_t>(n));
      if (t.rfind("socket:[", 0) == 0 && inodes.count(t.substr(8, t.size() - 9)) > 0) {
        std::string comm;
        std::getline(std::ifstream("/proc/" + pid + "/comm"), comm);
        owner = "pid " + pid + " (" + comm + ")";
        break;
      }
    }
    closedir(fds);
    if (!owner.empty()) break;
  }
  closedir(proc);
  return owner.empty() ? "another process" : owner;
}

}  // namespace pippy
