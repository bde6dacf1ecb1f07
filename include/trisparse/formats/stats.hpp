#pragma once
/// @file Format statistics as in the Fused3S paper: Table 6 (TCB/RW and nnz/TCB, mean and CV),
/// Table 7 (TCB-per-window deciles) and Table 3 (memory footprint per format).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trisparse/formats/bsb.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse {

struct bsb_stats {
  int tcb_cols = 8;
  std::int64_t windows = 0, tcbs = 0, nnz = 0;
  double tcb_per_window_mean = 0, tcb_per_window_cv = 0;
  double nnz_per_tcb_mean = 0, nnz_per_tcb_cv = 0;
  /// Min and max TCB count in each tenth of the windows sorted by TCB count (Table 7).
  std::vector<std::pair<std::int64_t, std::int64_t>> deciles;
  std::int64_t max_tcbs_in_window = 0;
};
bsb_stats compute_stats(const bsb& format, std::int64_t nnz);

/// Footprint of one format in bytes (Table 3's formulas with b, c measured on this pattern).
struct footprint {
  std::string format;
  std::int64_t bytes = 0;
  bool binary = false;  ///< stores only the pattern (no values)
};
/// Table 3 for a pattern: CSR, SR-BCSR, ME-BCRS, BCSR, TCF, ME-TCF, BitTCF, BSB at r = 16, c = 8.
std::vector<footprint> table3_footprints(const csr_graph& g);

}  // namespace trisparse
