#include "trisparse/graph/reorder.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "trisparse/core/error.hpp"
#include "trisparse/core/random.hpp"

namespace trisparse {

std::string_view to_string(row_order o) {
  switch (o) {
    case row_order::automatic:
      return "automatic";
    case row_order::original:
      return "original";
    case row_order::rcm:
      return "rcm";
    case row_order::clustered:
      return "clustered";
  }
  return "?";
}

row_order parse_row_order(std::string_view name) {
  for (const auto o :
       {row_order::automatic, row_order::original, row_order::rcm, row_order::clustered}) {
    if (to_string(o) == name) return o;
  }
  if (name == "auto") return row_order::automatic;
  throw invalid_input("unknown row order '" + std::string(name) +
                      "' (automatic, original, rcm, clustered)");
}

std::vector<std::int64_t> reverse_cuthill_mckee(const csr_graph& g) {
  TRISPARSE_EXPECTS_INPUT(g.rows == g.cols, "reverse_cuthill_mckee needs a square pattern");
  const std::int64_t n = g.rows;
  // Undirected adjacency: A + A^T (self loops and repeats do not matter to the search).
  const csr_graph t = transpose(g);
  const auto degree = [&](std::int64_t v) { return g.degree(v) + t.degree(v); };
  std::vector<std::int64_t> by_degree(static_cast<std::size_t>(n));
  std::iota(by_degree.begin(), by_degree.end(), 0);
  std::stable_sort(by_degree.begin(), by_degree.end(),
                   [&](std::int64_t a, std::int64_t b) { return degree(a) < degree(b); });
  std::vector<char> seen(static_cast<std::size_t>(n), 0);
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(n));
  std::vector<std::int64_t> next;
  for (const std::int64_t start : by_degree) {
    if (seen[start]) continue;
    seen[start] = 1;
    order.push_back(start);
    for (std::size_t head = order.size() - 1; head < order.size(); ++head) {
      const std::int64_t v = order[head];
      next.clear();
      for (const csr_graph* a : {&g, &t}) {
        for (std::int64_t e = a->row_ptr[v]; e < a->row_ptr[v + 1]; ++e) {
          const std::int64_t u = a->col_idx[e];
          if (!seen[u]) {
            seen[u] = 1;
            next.push_back(u);
          }
        }
      }
      std::stable_sort(next.begin(), next.end(), [&](std::int64_t a, std::int64_t b) {
        return degree(a) != degree(b) ? degree(a) < degree(b) : a < b;
      });
      order.insert(order.end(), next.begin(), next.end());
    }
  }
  std::reverse(order.begin(), order.end());
  return order;
}

std::vector<std::int64_t> cluster_rows(const csr_graph& g, int window_rows,
                                       std::span<const std::int64_t> seeds,
                                       std::int64_t max_column_rows) {
  TRISPARSE_EXPECTS_INPUT(window_rows >= 1, "cluster_rows: window_rows must be >= 1");
  const std::int64_t n = g.rows;
  const auto size = static_cast<std::size_t>(n);
  std::vector<char> used(size, 0);
  if (!seeds.empty()) {
    TRISPARSE_EXPECTS_INPUT(static_cast<std::int64_t>(seeds.size()) == n,
                            "cluster_rows: seeds must list every row once");
    for (const std::int64_t r : seeds) {
      TRISPARSE_EXPECTS_INPUT(
          r >= 0 && r < n && !used[static_cast<std::size_t>(r)],
          "cluster_rows: seeds must list every row once (row " + std::to_string(r) + ")");
      used[static_cast<std::size_t>(r)] = 1;
    }
    std::fill(used.begin(), used.end(), 0);
  }
  const csr_graph by_column = transpose(g);  // column -> the rows holding it
  std::vector<std::int32_t> score(size, 0);
  std::vector<std::int64_t> column_window(static_cast<std::size_t>(g.cols), -1);
  std::vector<std::int64_t> order, touched;
  order.reserve(size);
  std::int64_t window = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t seed = seeds.empty() ? i : seeds[static_cast<std::size_t>(i)];
    if (used[static_cast<std::size_t>(seed)]) continue;
    touched.clear();
    std::int64_t row = seed;
    for (int filled = 1;; ++filled) {
      used[static_cast<std::size_t>(row)] = 1;
      order.push_back(row);
      if (filled == window_rows) break;
      // Rows sharing the new row's columns (those not already in the window) gain a point each.
      for (std::int64_t e = g.row_ptr[row]; e < g.row_ptr[row + 1]; ++e) {
        const std::int32_t c = g.col_idx[e];
        auto& seen = column_window[static_cast<std::size_t>(c)];
        if (seen == window) continue;
        seen = window;
        if (by_column.degree(c) > max_column_rows) continue;
        for (std::int64_t k = by_column.row_ptr[c]; k < by_column.row_ptr[c + 1]; ++k) {
          const auto r = static_cast<std::size_t>(by_column.col_idx[k]);
          if (used[r]) continue;
          if (score[r]++ == 0) touched.push_back(by_column.col_idx[k]);
        }
      }
      std::int64_t best = -1;
      std::int32_t best_score = 0;
      for (const std::int64_t r : touched) {
        const auto ur = static_cast<std::size_t>(r);
        if (!used[ur] && score[ur] > best_score) {
          best_score = score[ur];
          best = r;
        }
      }
      if (best < 0) break;  // nothing shares a column: the next seed starts a new window
      row = best;
    }
    for (const std::int64_t r : touched) score[static_cast<std::size_t>(r)] = 0;
    ++window;
  }
  return order;
}

std::int64_t count_window_columns(const csr_graph& g, int window_rows,
                                  std::span<const std::int64_t> order) {
  TRISPARSE_EXPECTS_INPUT(window_rows >= 1, "count_window_columns: window_rows must be >= 1");
  TRISPARSE_EXPECTS_INPUT(order.empty() || static_cast<std::int64_t>(order.size()) == g.rows,
                          "count_window_columns: the order must list every row");
  std::vector<std::int64_t> column_window(static_cast<std::size_t>(g.cols), -1);
  std::int64_t total = 0;
  for (std::int64_t i = 0; i < g.rows; ++i) {
    const std::int64_t r = order.empty() ? i : order[static_cast<std::size_t>(i)];
    TRISPARSE_EXPECTS_INPUT(r >= 0 && r < g.rows,
                            "count_window_columns: row " + std::to_string(r) + " out of range");
    const std::int64_t w = i / window_rows;
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      auto& seen = column_window[static_cast<std::size_t>(g.col_idx[e])];
      if (seen != w) {
        seen = w;
        ++total;
      }
    }
  }
  return total;
}

std::vector<std::int64_t> community_order(const csr_graph& g, std::uint64_t seed, int rounds) {
  TRISPARSE_EXPECTS_INPUT(g.rows == g.cols, "community_order needs a square pattern");
  const std::int64_t n = g.rows;
  build_options undirected;
  undirected.symmetrize = true;
  undirected.loops = self_loops::remove;
  const csr_graph u = preprocess(g, undirected);
  std::vector<std::int64_t> label(static_cast<std::size_t>(n)), visit(label.size());
  std::iota(label.begin(), label.end(), 0);
  std::iota(visit.begin(), visit.end(), 0);
  rng r(seed);
  std::vector<std::int64_t> count(label.size(), 0), touched;
  for (int round = 0; round < rounds; ++round) {
    for (std::int64_t i = n - 1; i > 0; --i)  // Fisher-Yates
      std::swap(visit[static_cast<std::size_t>(i)],
                visit[r.below(static_cast<std::uint64_t>(i) + 1)]);
    bool changed = false;
    for (const std::int64_t v : visit) {
      if (u.degree(v) == 0) continue;
      touched.clear();
      for (std::int64_t e = u.row_ptr[v]; e < u.row_ptr[v + 1]; ++e) {
        const auto l = static_cast<std::size_t>(label[static_cast<std::size_t>(u.col_idx[e])]);
        if (count[l]++ == 0) touched.push_back(static_cast<std::int64_t>(l));
      }
      const std::int64_t own = label[static_cast<std::size_t>(v)];
      std::int64_t most = 0, best = own;
      for (const std::int64_t l : touched)
        most = std::max(most, count[static_cast<std::size_t>(l)]);
      if (count[static_cast<std::size_t>(own)] < most) {  // else keep its own label
        best = n;
        for (const std::int64_t l : touched)
          if (count[static_cast<std::size_t>(l)] == most) best = std::min(best, l);
      }
      for (const std::int64_t l : touched) count[static_cast<std::size_t>(l)] = 0;
      if (best != label[static_cast<std::size_t>(v)]) {
        label[static_cast<std::size_t>(v)] = best;
        changed = true;
      }
    }
    if (!changed) break;
  }
  std::vector<std::int64_t> order = reverse_cuthill_mckee(u);
  std::vector<std::int64_t> rank(label.size(), -1);
  std::int64_t next = 0;
  for (const std::int64_t v : order) {
    std::int64_t& x = rank[static_cast<std::size_t>(label[static_cast<std::size_t>(v)])];
    if (x < 0) x = next++;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return rank[static_cast<std::size_t>(label[static_cast<std::size_t>(a)])] <
           rank[static_cast<std::size_t>(label[static_cast<std::size_t>(b)])];
  });
  return order;
}

}  // namespace trisparse
