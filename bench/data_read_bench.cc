// How fast one rank reads a token dataset (stage::Dataset, as a worker's rank reads
// it: pread of each window, ids checked against the embedding, int64 inputs and
// targets), over one epoch in order or shuffled. bench/data_bench.sh runs it beside
// `cat` of the same files to /dev/null.
//
//   data_read_bench DIR SEQ_LEN BATCH [on|off] [MAX_SECONDS] [both|inputs|targets]
// prints one line of JSON: samples, tokens, bytes, seconds, tokens_per_second.
// `inputs` reads as the first stage's rank does, `targets` as the last stage's, `both`
// as a rank holding both (one stage, or a V-shaped schedule's rank 0).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "pipeline/stage/dataset.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s DIR SEQ_LEN BATCH [on|off] [MAX_SECONDS] [both|inputs|targets]\n", argv[0]);
    return 2;
  }
  pippy::DatasetSpec spec;
  spec.set_path(argv[1]);
  spec.set_seq_len(std::atoi(argv[2]));
  spec.set_token_dtype(pippy::TOKEN_DTYPE_UINT16);
  spec.set_shuffle(argc > 4 && std::string(argv[4]) == "on");
  const int64_t batch = std::atoll(argv[3]);
  const double max_seconds = argc > 5 ? std::atof(argv[5]) : 1e9;
  const std::string which = argc > 6 ? argv[6] : "both";
  if (which != "both" && which != "inputs" && which != "targets") {
    std::fprintf(stderr, "which rank: both, inputs or targets, not '%s'\n", which.c_str());
    return 2;
  }
  const std::vector<int> input_indices = which == "targets" ? std::vector<int>{} : std::vector<int>{0};
  const std::vector<std::string> roots = {"/"};
  auto layout = pippy::stage::IndexDataset(spec, {"idx"}, batch, roots);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s\n", std::string(layout.status().message()).c_str());
    return 1;
  }
  layout->set_token_limit(1 << 16);  // every id is checked, as against an embedding
  auto data = pippy::stage::Dataset::Open(spec, *layout, {"idx"}, input_indices,
                                           /*with_targets=*/which != "inputs", batch, 0, roots);
  if (!data.ok()) {
    std::fprintf(stderr, "%s\n", std::string(data.status().message()).c_str());
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0;
  int64_t steps = 0;
  for (; steps < layout->steps_per_epoch() && seconds < max_seconds; ++steps) {
    auto b = (*data)->Read(steps, batch, 0, 1);
    if (!b.ok()) {
      std::fprintf(stderr, "%s\n", std::string(b.status().message()).c_str());
      return 1;
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const int64_t samples = steps * batch, tokens = samples * spec.seq_len();
  std::printf("{\"samples\": %lld, \"tokens\": %lld, \"bytes\": %lld, \"seconds\": %.4f, \"tokens_per_second\": %.1f}\n",
              static_cast<long long>(samples), static_cast<long long>(tokens),
              static_cast<long long>((*data)->bytes_read()), seconds, static_cast<double>(tokens) / seconds);
  return 0;
}
