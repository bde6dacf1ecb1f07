#include "trisparse/graph/reorder.hpp"

#include <algorithm>
#include <numeric>

#include "trisparse/core/error.hpp"

namespace trisparse {

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

}  // namespace trisparse
