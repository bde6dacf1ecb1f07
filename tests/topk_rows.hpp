#pragma once
// Test helper: checks a selected top-k block mask (topk_mask_options' definition) row by row
// against the pooled scores in float64, for the CPU's and the device's selections.
#include <algorithm>
#include <numeric>
#include <vector>

#include "support.hpp"

namespace trisparse::test {

// Block means (float64) of rows [row0, row0 + rows) of head h.
inline std::vector<double> block_mean(const host_tensor& t, std::int64_t row0, std::int64_t rows,
                                      std::int64_t h) {
  std::vector<double> m(static_cast<std::size_t>(t.view().dim), 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t d = 0; d < t.view().dim; ++d)
      m[static_cast<std::size_t>(d)] +=
          t.get(t.view().offset(row0 + i, h, d)) / static_cast<double>(rows);
  return m;
}

// Every row of a selected mask holds min(top_k, allowed) blocks no worse than any allowed
// block left out (scores in float64; a gap under 1e-5 is a tie a float32 selection may break either
// way) plus the diagonal where o asks for it.
inline void expect_topk_rows(const block_sparse_mask& got, const host_tensor& hq,
                             const host_tensor& hk, const topk_mask_options& o) {
  const std::int64_t g = o.block, heads = got.heads;
  const double tol = 1e-5;
  for (std::int64_t b = 0; b < got.batch(); ++b) {
    const std::int64_t lq = got.len_q(b), lk = got.len_k(b), nbk = (lk + g - 1) / g;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::vector<std::vector<double>> key_means;
      for (std::int64_t c = 0; c < nbk; ++c)
        key_means.push_back(
            block_mean(hk, got.cu_seqlens_k[b] + c * g, std::min(g, lk - c * g), h));
      const csr_graph& rows = got.masks[static_cast<std::size_t>(b * heads + h)].blocks;
      for (std::int64_t r = 0; r < rows.rows; ++r) {
        const std::int64_t row = std::min(lq, (r + 1) * g) - 1;
        const std::int64_t last = got.last_key(b, row), aligned = row + lk - lq;
        const std::int64_t allowed = last < 0 ? 0 : last / g + 1;
        const auto qm = block_mean(hq, got.cu_seqlens_q[b] + r * g, std::min(g, lq - r * g), h);
        std::vector<double> score;
        for (std::int64_t c = 0; c < allowed; ++c) {
          const auto& km = key_means[static_cast<std::size_t>(c)];
          score.push_back(std::inner_product(qm.begin(), qm.end(), km.begin(), 0.0));
        }
        std::vector<bool> in(static_cast<std::size_t>(allowed), false);
        for (std::int64_t e = rows.row_ptr[r]; e < rows.row_ptr[r + 1]; ++e) {
          ASSERT_LT(rows.col_idx[e], allowed);
          in[static_cast<std::size_t>(rows.col_idx[e])] = true;
        }
        const std::int64_t diagonal =
            o.keep_diagonal && aligned >= 0 && lk > 0 ? std::min(aligned, lk - 1) / g : -1;
        if (diagonal >= 0) {
          EXPECT_TRUE(in[static_cast<std::size_t>(diagonal)]);
        }
        // The top-k part: the chosen blocks other than a diagonal that only the diagonal rule
        // explains; at least the k-th best score, up to tol.
        std::vector<double> chosen, left;
        for (std::int64_t c = 0; c < allowed; ++c)
          (in[static_cast<std::size_t>(c)] ? chosen : left).push_back(score[c]);
        const std::int64_t keep = std::min(o.top_k, allowed);
        std::sort(chosen.rbegin(), chosen.rend());
        ASSERT_GE(static_cast<std::int64_t>(chosen.size()), keep);
        ASSERT_LE(static_cast<std::int64_t>(chosen.size()), keep + (diagonal >= 0));
        if (keep > 0 && !left.empty()) {
          const double kth = chosen[static_cast<std::size_t>(keep - 1)];
          EXPECT_GE(kth, *std::max_element(left.begin(), left.end()) - tol)
              << "sequence " << b << " head " << h << " block row " << r;
        }
      }
    }
  }
}

}  // namespace trisparse::test
