// Choosing cut positions: by module path (--split-at), by PipeSplit markers, or
// automatically into K stages of balanced cost.
//
// Errors: INVALID_ARGUMENT with a message that names the split point or value and
// what to use instead (nearest module names, nearest legal cuts).
#ifndef PIPPY_PIPELINE_PARTITION_CUT_SELECTION_H_
#define PIPPY_PIPELINE_PARTITION_CUT_SELECTION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/model_graph.h"

namespace pippy::partition {

// `split_at` entries are module paths: "blocks.4" cuts before that module's first
// operation, "blocks.4:end" after its last one. Returns sorted cut positions.
absl::StatusOr<std::vector<int>> CutsFromSplitAt(const ModelGraph& mg,
                                                 const std::vector<std::string>& split_at);

// The cuts marked by PipeSplit modules, checked for legality.
absl::StatusOr<std::vector<int>> CutsFromMarkers(const ModelGraph& mg);

// K-1 legal cuts minimising the largest stage cost (op_costs[i] is op i's cost),
// preferring cuts at major module boundaries when that costs at most `slack` of the
// optimum. `candidates` (sorted, legal) restricts the cuts considered; empty = all
// legal cuts.
absl::StatusOr<std::vector<int>> BalancedCuts(const ModelGraph& mg, int num_stages,
                                              const std::vector<double>& op_costs,
                                              const std::vector<int>& candidates = {},
                                              double slack = 0.05);

// A --split-at spelling of cut c ("blocks.4" or "blocks.3:end"), or "" if no module
// path names exactly that cut.
std::string CutName(const ModelGraph& mg, int c);

// Module paths closest to `name` (edit distance), best first.
std::vector<std::string> NearestModulePaths(const ModelGraph& mg, const std::string& name,
                                            size_t limit = 5);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_CUT_SELECTION_H_
