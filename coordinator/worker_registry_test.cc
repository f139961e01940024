// GroupByHost: a tensor-parallel group's workers share a host wherever the hosts allow.
#include "coordinator/worker_registry.h"

#include <map>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pippy::coordinator {
namespace {

// The hosts of each group (replica, rank) of a placement `out` (global rank order).
std::vector<std::set<std::string>> GroupHosts(const std::vector<std::string>& out, int ranks, int tp,
                                              const std::map<std::string, std::string>& host) {
  std::vector<std::set<std::string>> groups;
  const int replicas = static_cast<int>(out.size()) / (ranks * tp);
  for (int r = 0; r < replicas; ++r) {
    for (int k = 0; k < ranks; ++k) {
      std::set<std::string> hosts;
      for (int t = 0; t < tp; ++t) hosts.insert(host.at(out[static_cast<size_t>((r * tp + t) * ranks + k)]));
      groups.push_back(hosts);
    }
  }
  return groups;
}

TEST(GroupByHost, EachGroupOnOneHostWhereTheHostsAllow) {
  // 2 ranks x 2 shards on 2 hosts of 2 workers each, chosen interleaved (a, b, a, b): the
  // order Fit could give. Each group must end up on one host.
  std::map<std::string, std::string> host = {{"w0", "a"}, {"w1", "b"}, {"w2", "a"}, {"w3", "b"}};
  auto of = [&](const std::string& id) { return host.at(id); };
  const std::vector<std::string> chosen = {"w0", "w1", "w2", "w3"};
  std::vector<std::string> out = GroupByHost(chosen, /*ranks=*/2, /*tp=*/2, of);
  EXPECT_EQ(std::multiset<std::string>(out.begin(), out.end()), std::multiset<std::string>(chosen.begin(), chosen.end()));
  for (const auto& hosts : GroupHosts(out, 2, 2, host)) EXPECT_EQ(hosts.size(), 1u);
  // With replicas: 2 replicas x 2 ranks x 2 shards on 4 hosts of 2.
  std::map<std::string, std::string> h8;
  std::vector<std::string> c8;
  for (int i = 0; i < 8; ++i) {
    c8.push_back("w" + std::to_string(i));
    h8[c8.back()] = std::string(1, static_cast<char>('a' + i % 4));
  }
  out = GroupByHost(c8, 2, 2, [&](const std::string& id) { return h8.at(id); });
  EXPECT_EQ(std::set<std::string>(out.begin(), out.end()).size(), 8u);
  for (const auto& hosts : GroupHosts(out, 2, 2, h8)) EXPECT_EQ(hosts.size(), 1u);
  // Hosts of 3 and 1 workers: one group fits a host, the other must span two.
  std::map<std::string, std::string> h3 = {{"w0", "a"}, {"w1", "a"}, {"w2", "a"}, {"w3", "b"}};
  out = GroupByHost(chosen, 2, 2, [&](const std::string& id) { return h3.at(id); });
  std::multiset<size_t> sizes;
  for (const auto& hosts : GroupHosts(out, 2, 2, h3)) sizes.insert(hosts.size());
  EXPECT_EQ(sizes, (std::multiset<size_t>{1, 2}));
  // No tensor parallelism: as chosen.
  EXPECT_EQ(GroupByHost(chosen, 4, 1, of), chosen);
}

}  // namespace
}  // namespace pippy::coordinator
