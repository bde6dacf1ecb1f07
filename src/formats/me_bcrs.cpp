#include "trisparse/formats/me_bcrs.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "trisparse/core/error.hpp"

namespace trisparse {

namespace {
[[noreturn]] void broken(const std::string& why) {
  throw invalid_input("me_bcrs invariant broken: " + why);
}
float value_of(const csr_graph& g, std::int64_t e) { return g.has_values() ? g.values[e] : 1.0f; }
}  // namespace

std::int64_t me_bcrs::bytes() const {
  return static_cast<std::int64_t>(8 * row_ptr.size() + 4 * col_idx.size() + 4 * values.size());
}

std::int64_t me_bcrs::sr_bcrs_bytes() const {
  // SR-BCRS pads every window to whole blocks and keeps a second offset array (blocks per window).
  std::int64_t padded = 0;
  for (std::int64_t w = 0; w < windows(); ++w) {
    const std::int64_t n = row_ptr[w + 1] - row_ptr[w];
    padded += (n + block_cols - 1) / block_cols * block_cols;
  }
  return 16 * static_cast<std::int64_t>(row_ptr.size()) + 4 * padded + 4 * padded * vector_rows;
}

me_bcrs_view me_bcrs::view() const {
  return {rows,       cols,           windows(),      vectors(),    vector_rows,
          block_cols, row_ptr.data(), col_idx.data(), values.data()};
}

me_bcrs build_me_bcrs(const csr_graph& g, int vector_rows, int block_cols) {
  g.check();
  TRISPARSE_EXPECTS_INPUT(vector_rows == 8 || vector_rows == 16,
                          "ME-BCRS vector_rows must be 8 or 16");
  TRISPARSE_EXPECTS_INPUT(block_cols == 4 || block_cols == 8 || block_cols == 16,
                          "ME-BCRS block_cols must be 4, 8 or 16");
  me_bcrs f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.vector_rows = vector_rows;
  f.block_cols = block_cols;
  const std::int64_t windows = (g.rows + vector_rows - 1) / vector_rows;
  std::vector<std::vector<std::int32_t>> cols(windows);
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t w = 0; w < windows; ++w) {
    auto& c = cols[w];
    for (std::int64_t r = w * vector_rows; r < std::min(g.rows, (w + 1) * vector_rows); ++r) {
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
        if (value_of(g, e) != 0.0f) c.push_back(g.col_idx[e]);
      }
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  f.row_ptr.assign(windows + 1, 0);
  for (std::int64_t w = 0; w < windows; ++w)
    f.row_ptr[w + 1] = f.row_ptr[w] + static_cast<std::int64_t>(cols[w].size());
  f.col_idx.resize(f.vectors());
  f.values.assign(f.vectors() * vector_rows, 0.0f);
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t w = 0; w < windows; ++w) {
    const auto& c = cols[w];
    std::copy(c.begin(), c.end(), f.col_idx.begin() + f.row_ptr[w]);
    for (std::int64_t r = w * vector_rows; r < std::min(g.rows, (w + 1) * vector_rows); ++r) {
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
        if (value_of(g, e) == 0.0f) continue;
        const std::int64_t v = std::lower_bound(c.begin(), c.end(), g.col_idx[e]) - c.begin();
        f.values[f.value_index(w, v, static_cast<int>(r - w * vector_rows))] = value_of(g, e);
      }
    }
  }
  return f;
}

void me_bcrs::check() const {
  if (vector_rows != 8 && vector_rows != 16)
    broken("vector_rows is " + std::to_string(vector_rows));
  if (block_cols < 1) broken("block_cols < 1");
  if (windows() != (rows + vector_rows - 1) / vector_rows)
    broken("window count does not match rows");
  if (row_ptr.front() != 0) broken("row_ptr[0] != 0");
  if (static_cast<std::int64_t>(col_idx.size()) != vectors()) broken("col_idx size != vectors");
  if (static_cast<std::int64_t>(values.size()) != vectors() * vector_rows)
    broken("values size != vectors * vector_rows");
  for (std::int64_t w = 0; w < windows(); ++w) {
    if (row_ptr[w + 1] < row_ptr[w]) broken("row_ptr decreases at window " + std::to_string(w));
    const std::int64_t n = row_ptr[w + 1] - row_ptr[w];
    const std::int64_t valid_rows = std::min<std::int64_t>(vector_rows, rows - w * vector_rows);
    for (std::int64_t v = 0; v < n; ++v) {
      const std::int32_t c = col_idx[row_ptr[w] + v];
      if (c < 0 || c >= cols) broken("column " + std::to_string(c) + " out of range");
      if (v > 0 && c <= col_idx[row_ptr[w] + v - 1])
        broken("columns not increasing in window " + std::to_string(w));
      bool any = false;
      for (int r = 0; r < vector_rows; ++r) {
        const float x = values[value_index(w, v, r)];
        if (!std::isfinite(x)) broken("non-finite value in window " + std::to_string(w));
        if (x != 0.0f && r >= valid_rows) broken("value on a row past the matrix");
        any |= x != 0.0f;
      }
      if (!any) broken("an all-zero vector in window " + std::to_string(w));
    }
  }
}

csr_graph to_csr(const me_bcrs& f, bool with_values) {
  coo_graph coo;
  coo.rows = f.rows;
  coo.cols = f.cols;
  for (std::int64_t w = 0; w < f.windows(); ++w) {
    for (std::int64_t v = 0; v < f.row_ptr[w + 1] - f.row_ptr[w]; ++v) {
      for (int r = 0; r < f.vector_rows; ++r) {
        const float x = f.values[f.value_index(w, v, r)];
        if (x == 0.0f) continue;
        coo.src.push_back(w * f.vector_rows + r);
        coo.dst.push_back(f.col_idx[f.row_ptr[w] + v]);
        if (with_values) coo.values.push_back(x);
      }
    }
  }
  return to_csr(coo);
}

}  // namespace trisparse
