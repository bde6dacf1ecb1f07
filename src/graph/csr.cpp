#include "trisparse/graph/csr.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "trisparse/core/error.hpp"

namespace trisparse {

namespace {
[[noreturn]] void broken(const char* type, const std::string& why) {
  throw invalid_input(std::string(type) + " invariant broken: " + why);
}
constexpr std::int64_t kMaxCols = std::numeric_limits<std::int32_t>::max();
}  // namespace

void csr_graph::check() const {
  if (rows < 0 || cols < 0) broken("csr", "negative shape");
  if (cols > kMaxCols) broken("csr", "cols " + std::to_string(cols) + " exceed 32-bit indices");
  if (static_cast<std::int64_t>(row_ptr.size()) != rows + 1) {
    broken("csr", "row_ptr has " + std::to_string(row_ptr.size()) +
                      " entries, expected rows + 1 = " + std::to_string(rows + 1));
  }
  if (row_ptr.front() != 0) broken("csr", "row_ptr[0] != 0");
  if (row_ptr.back() != nnz()) broken("csr", "row_ptr[rows] != nnz");
  if (!values.empty() && static_cast<std::int64_t>(values.size()) != nnz()) {
    broken("csr", "values has " + std::to_string(values.size()) + " entries, nnz is " +
                      std::to_string(nnz()));
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    if (row_ptr[r + 1] < row_ptr[r]) broken("csr", "row_ptr decreases at row " + std::to_string(r));
    for (std::int64_t e = row_ptr[r]; e < row_ptr[r + 1]; ++e) {
      if (col_idx[e] < 0 || col_idx[e] >= cols) {
        broken("csr", "column " + std::to_string(col_idx[e]) + " out of range in row " +
                          std::to_string(r));
      }
      if (e > row_ptr[r] && col_idx[e] <= col_idx[e - 1]) {
        broken("csr", "columns not strictly increasing in row " + std::to_string(r));
      }
    }
  }
  for (std::size_t e = 0; e < values.size(); ++e) {
    if (!std::isfinite(values[e])) broken("csr", "non-finite value at entry " + std::to_string(e));
  }
}

void coo_graph::check() const {
  if (rows < 0 || cols < 0) broken("coo", "negative shape");
  if (cols > kMaxCols) broken("coo", "cols " + std::to_string(cols) + " exceed 32-bit indices");
  if (src.size() != dst.size()) broken("coo", "src and dst differ in length");
  if (!values.empty() && values.size() != src.size()) broken("coo", "values length != edges");
  for (std::size_t e = 0; e < src.size(); ++e) {
    if (src[e] < 0 || src[e] >= rows || dst[e] < 0 || dst[e] >= cols) {
      broken("coo", "edge " + std::to_string(e) + " (" + std::to_string(src[e]) + ", " +
                        std::to_string(dst[e]) + ") outside " + std::to_string(rows) + " x " +
                        std::to_string(cols));
    }
    if (!values.empty() && !std::isfinite(values[e])) {
      broken("coo", "non-finite value at edge " + std::to_string(e));
    }
  }
}

csr_graph to_csr(const coo_graph& coo, const build_options& options) {
  coo.check();
  if (options.symmetrize && coo.rows != coo.cols) {
    throw invalid_input("cannot symmetrize a " + std::to_string(coo.rows) + " x " +
                        std::to_string(coo.cols) + " (rectangular) pattern");
  }
  const bool weighted = !coo.values.empty();
  const std::int64_t loops =
      options.loops == self_loops::add ? std::min(coo.rows, coo.cols) : std::int64_t{0};
  const std::int64_t m = coo.nnz();

  // Bucket (row, col, value) by row: counting sort, O(nnz).
  std::vector<std::int64_t> count(coo.rows + 1, 0);
  const auto keep = [&](std::int64_t s, std::int64_t d) {
    return !(options.loops == self_loops::remove && s == d);
  };
  for (std::int64_t e = 0; e < m; ++e) {
    if (!keep(coo.src[e], coo.dst[e])) continue;
    ++count[coo.src[e] + 1];
    if (options.symmetrize && coo.src[e] != coo.dst[e]) ++count[coo.dst[e] + 1];
  }
  for (std::int64_t i = 0; i < loops; ++i) ++count[i + 1];
  std::partial_sum(count.begin(), count.end(), count.begin());
  const std::int64_t total = count.back();
  std::vector<std::int32_t> cols(total);
  std::vector<float> vals(weighted ? total : 0);
  std::vector<std::int64_t> cursor(count.begin(), count.end() - 1);
  const auto put = [&](std::int64_t r, std::int64_t c, float v) {
    const std::int64_t at = cursor[r]++;
    cols[at] = static_cast<std::int32_t>(c);
    if (weighted) vals[at] = v;
  };
  for (std::int64_t e = 0; e < m; ++e) {
    if (!keep(coo.src[e], coo.dst[e])) continue;
    const float v = weighted ? coo.values[e] : 1.0f;
    put(coo.src[e], coo.dst[e], v);
    if (options.symmetrize && coo.src[e] != coo.dst[e]) put(coo.dst[e], coo.src[e], v);
  }
  // Added self loops go last in their bucket, marked NaN (inputs are finite), so that a stored loop
  // keeps its own value and an added one gets 1.
  for (std::int64_t i = 0; i < loops; ++i) put(i, i, std::numeric_limits<float>::quiet_NaN());

  // Sort each row (stable: duplicates keep input order) and merge duplicates.
  std::vector<std::int64_t> kept(coo.rows, 0);
#pragma omp parallel for schedule(dynamic, 256)
  for (std::int64_t r = 0; r < coo.rows; ++r) {
    const std::int64_t b = count[r], e = count[r + 1];
    if (weighted) {
      std::vector<std::pair<std::int32_t, float>> row(e - b);
      for (std::int64_t i = b; i < e; ++i) row[i - b] = {cols[i], vals[i]};
      std::stable_sort(row.begin(), row.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      std::int64_t out = b;
      for (const auto& [col, val] : row) {
        const bool added_loop = std::isnan(val);
        if (out > b && cols[out - 1] == col) {
          if (options.sum_duplicates && !added_loop) vals[out - 1] += val;
          continue;
        }
        cols[out] = col;
        vals[out] = added_loop ? 1.0f : val;
        ++out;
      }
      kept[r] = out - b;
    } else {
      std::sort(cols.begin() + b, cols.begin() + e);
      kept[r] = std::unique(cols.begin() + b, cols.begin() + e) - (cols.begin() + b);
    }
  }
  csr_graph g;
  g.rows = coo.rows;
  g.cols = coo.cols;
  g.row_ptr.assign(coo.rows + 1, 0);
  for (std::int64_t r = 0; r < coo.rows; ++r) g.row_ptr[r + 1] = g.row_ptr[r] + kept[r];
  g.col_idx.resize(g.row_ptr.back());
  if (weighted) g.values.resize(g.row_ptr.back());
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < coo.rows; ++r) {
    std::copy_n(cols.begin() + count[r], kept[r], g.col_idx.begin() + g.row_ptr[r]);
    if (weighted) std::copy_n(vals.begin() + count[r], kept[r], g.values.begin() + g.row_ptr[r]);
  }
  return g;
}

coo_graph to_coo(const csr_graph& g) {
  coo_graph coo;
  coo.rows = g.rows;
  coo.cols = g.cols;
  coo.src.resize(g.nnz());
  coo.dst.assign(g.col_idx.begin(), g.col_idx.end());
  coo.values = g.values;
  for (std::int64_t r = 0; r < g.rows; ++r) {
    std::fill(coo.src.begin() + g.row_ptr[r], coo.src.begin() + g.row_ptr[r + 1], r);
  }
  return coo;
}

csr_graph preprocess(const csr_graph& g, const build_options& options) {
  return to_csr(to_coo(g), options);
}

csr_graph transpose(const csr_graph& g) {
  coo_graph coo = to_coo(g);
  std::swap(coo.src, coo.dst);
  std::swap(coo.rows, coo.cols);
  return to_csr(coo);
}

csr_graph select_rows(const csr_graph& g, std::span<const std::int64_t> rows) {
  csr_graph s;
  s.rows = static_cast<std::int64_t>(rows.size());
  s.cols = g.cols;
  for (const auto r : rows) {
    if (r < 0 || r >= g.rows)
      throw invalid_input("select_rows: row " + std::to_string(r) + " out of range");
    s.col_idx.insert(s.col_idx.end(), g.col_idx.begin() + g.row_ptr[r],
                     g.col_idx.begin() + g.row_ptr[r + 1]);
    if (g.has_values())
      s.values.insert(s.values.end(), g.values.begin() + g.row_ptr[r],
                      g.values.begin() + g.row_ptr[r + 1]);
    s.row_ptr.push_back(s.nnz());
  }
  return s;
}

degree_stats compute_degree_stats(const csr_graph& g) {
  degree_stats s;
  if (g.rows == 0) return s;
  s.min = std::numeric_limits<std::int64_t>::max();
  double sum = 0, sum2 = 0;
  for (std::int64_t r = 0; r < g.rows; ++r) {
    const std::int64_t d = g.degree(r);
    s.min = std::min(s.min, d);
    s.max = std::max(s.max, d);
    s.empty_rows += d == 0;
    sum += static_cast<double>(d);
    sum2 += static_cast<double>(d) * static_cast<double>(d);
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e)
      s.self_loops += g.col_idx[e] == r;
  }
  const auto n = static_cast<double>(g.rows);
  s.mean = sum / n;
  s.stddev = std::sqrt(std::max(0.0, sum2 / n - s.mean * s.mean));
  if (g.rows == g.cols) {
    const csr_graph t = transpose(g);
    s.symmetric = t.row_ptr == g.row_ptr && t.col_idx == g.col_idx;
  }
  return s;
}

}  // namespace trisparse
