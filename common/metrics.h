// Prometheus metrics: the text exposition format (version 0.0.4) and a small HTTP
// server for /metrics (cpp-httplib, Debian's libcpp-httplib-dev).
//
// The daemons keep their own numbers (the coordinator's job and worker records, the
// worker's counters) and render them on every scrape: there is no registry to keep in
// step with them.
#ifndef PIPPY_COMMON_METRICS_H_
#define PIPPY_COMMON_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pippy::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

// Cumulative bucket counts for a histogram with fixed upper bounds (+Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }  // per bucket, not cumulative; last: +Inf
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Writes one scrape. Each family (name, TYPE, HELP) once, then its samples; label
// values escaped (\\, \", \n), values as Prometheus reads them (+Inf, -Inf, NaN).
class Exposition {
 public:
  // type: "counter" | "gauge" | "histogram".
  void Family(absl::string_view name, absl::string_view type, absl::string_view help);
  void Sample(absl::string_view name, const Labels& labels, double value);
  // name_bucket{le=...}, name_sum, name_count.
  void HistogramSamples(absl::string_view name, const Labels& labels, const Histogram& h);
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

// GET /metrics answers render() (text/plain; version=0.0.4); other paths 404.
class Server {
 public:
  // Listens on host:port (0: any free port) on its own thread.
  // Errors: UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const std::string& host, int port,
                                                       std::function<std::string()> render);
  ~Server();  // stops serving
  int port() const { return port_; }

 private:
  struct Impl;
  Server() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace pippy::metrics

#endif  // PIPPY_COMMON_METRICS_H_
