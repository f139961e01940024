#include "common/metrics.h"

#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/port_owner.h"
#include "absl/strings/str_format.h"
#include "httplib.h"

namespace pippy::metrics {
namespace {

std::string Value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  for (int digits = 15; digits < 17; ++digits) {  // the shortest that reads back the same
    std::string s = absl::StrFormat("%.*g", digits, v);
    if (std::strtod(s.c_str(), nullptr) == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

std::string Escape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string LabelText(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", labels[i].first, "=\"", Escape(labels[i].second), "\"");
  }
  return out + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  std::sort(bounds_.begin(), bounds_.end());
}

void Histogram::Observe(double v) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Exposition::Family(absl::string_view name, absl::string_view type, absl::string_view help) {
  std::string h;
  for (char c : help) h += c == '\n' ? std::string("\\n") : c == '\\' ? std::string("\\\\") : std::string(1, c);
  absl::StrAppend(&text_, "# HELP ", name, " ", h, "\n# TYPE ", name, " ", type, "\n");
}

void Exposition::Sample(absl::string_view name, const Labels& labels, double value) {
  absl::StrAppend(&text_, name, LabelText(labels), " ", Value(value), "\n");
}

void Exposition::HistogramSamples(absl::string_view name, const Labels& labels, const Histogram& h) {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= h.bounds().size(); ++i) {
    cumulative += h.counts()[i];
    Labels with = labels;
    with.emplace_back("le", i < h.bounds().size() ? Value(h.bounds()[i]) : "+Inf");
    Sample(absl::StrCat(name, "_bucket"), with, static_cast<double>(cumulative));
  }
  Sample(absl::StrCat(name, "_sum"), labels, h.sum());
  Sample(absl::StrCat(name, "_count"), labels, static_cast<double>(h.count()));
}

struct Server::Impl {
  httplib::Server http;
  std::thread thread;
};

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const std::string& host, int port,
                                                      std::function<std::string()> render) {
  std::unique_ptr<Server> s(new Server());
  s->impl_ = std::make_unique<Impl>();
  s->impl_->http.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // httplib's default sets SO_REUSEPORT, which lets a second daemon share the port
  // (the kernel would split scrapes between them): a port in use is refused instead.
  s->impl_->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int bound = port == 0 ? s->impl_->http.bind_to_any_port(host) : (s->impl_->http.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    const std::string owner = PortOwner(port);
    return absl::FailedPreconditionError(absl::StrCat(
        "--metrics-port ", port, ": ", host, ":", port, " is in use", owner.empty() ? "" : absl::StrCat(" by ", owner),
        "; choose another --metrics-port, or 0 for any free one"));
  }
  s->port_ = bound;
  Impl* impl = s->impl_.get();
  impl->thread = std::thread([impl] { impl->http.listen_after_bind(); });
  return s;
}

Server::~Server() {
  if (impl_ == nullptr) return;
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace pippy::metrics
