#include "trisparse/graph/generate.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "trisparse/core/error.hpp"
#include "trisparse/core/random.hpp"

namespace trisparse {

csr_graph generate_rmat(const rmat_options& o) {
  TRISPARSE_EXPECTS_INPUT(o.scale >= 0 && o.scale <= 30, "rmat scale must be in [0, 30]");
  TRISPARSE_EXPECTS_INPUT(o.edge_factor >= 0, "rmat edge_factor must be >= 0");
  const double d = 1.0 - o.a - o.b - o.c;
  TRISPARSE_EXPECTS_INPUT(o.a >= 0 && o.b >= 0 && o.c >= 0 && d >= -1e-12,
                          "rmat probabilities a, b, c must be >= 0 with a + b + c <= 1");
  const std::int64_t n = std::int64_t{1} << o.scale;
  const auto m = static_cast<std::int64_t>(std::llround(o.edge_factor * static_cast<double>(n)));
  coo_graph coo;
  coo.rows = coo.cols = n;
  coo.src.resize(m);
  coo.dst.resize(m);
  // Edges are drawn from independent streams per chunk so generation parallelises and the
  // result does not depend on the thread count.
  constexpr std::int64_t kChunk = 1 << 16;
#pragma omp parallel for schedule(dynamic)
  for (std::int64_t chunk = 0; chunk < (m + kChunk - 1) / kChunk; ++chunk) {
    rng r(o.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(chunk));
    for (std::int64_t e = chunk * kChunk; e < std::min(m, (chunk + 1) * kChunk); ++e) {
      std::int64_t s = 0, t = 0;
      for (int level = 0; level < o.scale; ++level) {
        const double u = r.uniform();
        const int quadrant = u < o.a ? 0 : u < o.a + o.b ? 1 : u < o.a + o.b + o.c ? 2 : 3;
        s = (s << 1) | (quadrant >> 1);
        t = (t << 1) | (quadrant & 1);
      }
      coo.src[e] = s;
      coo.dst[e] = t;
    }
  }
  build_options b;
  b.symmetrize = o.symmetrize;
  b.loops = o.remove_self_loops ? self_loops::remove : self_loops::keep;
  return to_csr(coo, b);
}

csr_graph generate_erdos_renyi(const erdos_renyi_options& o) {
  const std::int64_t cols = o.cols < 0 ? o.rows : o.cols;
  TRISPARSE_EXPECTS_INPUT(o.rows >= 0 && cols >= 0 && o.avg_degree >= 0,
                          "erdos_renyi needs rows, cols, avg_degree >= 0");
  const double cells = static_cast<double>(o.rows) * static_cast<double>(cols);
  const auto m = static_cast<std::int64_t>(
      std::min(cells, std::round(o.avg_degree * static_cast<double>(o.rows))));
  coo_graph coo;
  coo.rows = o.rows;
  coo.cols = cols;
  rng r(o.seed);
  if (static_cast<double>(m) > 0.25 * cells) {
    // Dense: Bernoulli per cell with the matching probability.
    const double p = static_cast<double>(m) / cells;
    for (std::int64_t i = 0; i < o.rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        if (r.uniform() < p) {
          coo.src.push_back(i);
          coo.dst.push_back(j);
        }
      }
    }
    return to_csr(coo);
  }
  // Sparse: draw until m distinct cells (duplicates merged by to_csr, then topped up).
  csr_graph g;
  std::int64_t want = m;
  while (true) {
    for (std::int64_t e = 0; e < want; ++e) {
      coo.src.push_back(static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(o.rows))));
      coo.dst.push_back(static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(cols))));
    }
    g = to_csr(coo);
    if (g.nnz() >= m) break;
    want = m - g.nnz();
  }
  return g;
}

namespace {

// Appends k distinct columns of [lo, lo + m) (k <= m), sorted: draws of the smaller of the set
// and its complement, redrawn until distinct.
void distinct_columns(rng& r, std::int64_t lo, std::int64_t m, std::int64_t k,
                      std::vector<std::int64_t>& scratch, std::vector<std::int32_t>& out) {
  const bool complement = 2 * k > m;
  const std::int64_t draw = complement ? m - k : k;
  scratch.clear();
  while (static_cast<std::int64_t>(scratch.size()) < draw) {
    const std::int64_t missing = draw - static_cast<std::int64_t>(scratch.size());
    for (std::int64_t e = 0; e < missing; ++e)
      scratch.push_back(static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(m))));
    std::sort(scratch.begin(), scratch.end());
    scratch.erase(std::unique(scratch.begin(), scratch.end()), scratch.end());
  }
  if (!complement) {
    for (const std::int64_t c : scratch) out.push_back(static_cast<std::int32_t>(lo + c));
    return;
  }
  std::size_t skip = 0;
  for (std::int64_t c = 0; c < m; ++c) {
    if (skip < scratch.size() && scratch[skip] == c)
      ++skip;
    else
      out.push_back(static_cast<std::int32_t>(lo + c));
  }
}

}  // namespace

csr_graph generate_sparse_matrix(const sparse_matrix_options& o) {
  const std::int64_t cols = o.cols < 0 ? o.rows : o.cols;
  TRISPARSE_EXPECTS_INPUT(o.rows >= 0 && cols >= 0 && o.band >= 0 && o.dense_rows >= 0,
                          "sparse matrix needs rows, cols, band and dense_rows >= 0");
  TRISPARSE_EXPECTS_INPUT(cols < (std::int64_t{1} << 31), "sparse matrix needs cols < 2^31");
  TRISPARSE_EXPECTS_INPUT(std::isfinite(o.avg_row) && o.avg_row >= 0,
                          "sparse matrix needs a finite avg_row >= 0");
  TRISPARSE_EXPECTS_INPUT(o.lengths != row_length_law::power_law || o.exponent > 1,
                          "a power-law row length needs exponent > 1 (a finite mean)");
  rng r(o.seed);
  csr_graph g;
  g.rows = o.rows;
  g.cols = cols;
  g.row_ptr.reserve(static_cast<std::size_t>(o.rows) + 1);
  g.col_idx.reserve(static_cast<std::size_t>(o.avg_row * static_cast<double>(o.rows)));
  const std::int64_t dense = std::min(o.dense_rows, o.rows);
  std::int64_t next_dense = 0;  // the next dense row's index among the dense rows
  const auto dense_row = [&](std::int64_t k) { return (2 * k + 1) * o.rows / (2 * dense); };
  const double k_min = o.avg_row * (o.exponent - 1) / o.exponent;  // Pareto scale for the mean
  std::vector<std::int64_t> scratch;
  for (std::int64_t i = 0; i < o.rows; ++i) {
    std::int64_t lo = 0, m = cols;
    double length = 0;
    if (next_dense < dense && dense_row(next_dense) == i) {
      ++next_dense;
      length = static_cast<double>(cols / 2);
    } else {
      if (o.band > 0) {
        const std::int64_t diagonal = o.rows > 0 ? i * cols / o.rows : 0;
        lo = std::max<std::int64_t>(0, diagonal - o.band);
        m = std::min(cols, diagonal + o.band + 1) - lo;
      }
      switch (o.lengths) {
        case row_length_law::constant:
          length = std::round(o.avg_row);
          break;
        case row_length_law::uniform:
          length = static_cast<double>(
              r.below(static_cast<std::uint64_t>(2 * std::llround(o.avg_row)) + 1));
          break;
        case row_length_law::power_law:
          length = std::ceil(k_min * std::pow(1.0 - r.uniform(), -1.0 / o.exponent));
          break;
      }
    }
    const auto k = static_cast<std::int64_t>(std::min(length, static_cast<double>(m)));
    distinct_columns(r, lo, std::max<std::int64_t>(m, 0), std::max<std::int64_t>(k, 0), scratch,
                     g.col_idx);
    g.row_ptr.push_back(g.nnz());
  }
  return g;
}

batched_graph generate_batch(const batch_options& o) {
  TRISPARSE_EXPECTS_INPUT(o.graphs >= 0 && o.min_nodes >= 1 && o.max_nodes >= o.min_nodes,
                          "batch needs graphs >= 0 and 1 <= min_nodes <= max_nodes");
  rng r(o.seed);
  batched_graph out;
  out.graph_ptr.push_back(0);
  coo_graph coo;
  for (std::int64_t g = 0; g < o.graphs; ++g) {
    const std::int64_t n =
        o.min_nodes + static_cast<std::int64_t>(
                          r.below(static_cast<std::uint64_t>(o.max_nodes - o.min_nodes + 1)));
    const std::int64_t base = out.graph_ptr.back();
    // A random spanning path keeps each small graph connected, like a molecule's backbone.
    for (std::int64_t i = 1; i < n; ++i) {
      coo.src.push_back(base + i);
      coo.dst.push_back(base + static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(i))));
    }
    const auto extra = static_cast<std::int64_t>(
        std::max(0.0, o.avg_degree * static_cast<double>(n) / 2 - static_cast<double>(n - 1)));
    for (std::int64_t e = 0; e < extra; ++e) {
      coo.src.push_back(base + static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(n))));
      coo.dst.push_back(base + static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(n))));
    }
    out.graph_ptr.push_back(base + n);
  }
  coo.rows = coo.cols = out.graph_ptr.back();
  build_options b;
  b.symmetrize = true;
  b.loops = self_loops::remove;
  out.graph = to_csr(coo, b);
  return out;
}

csr_graph generate_sequence_mask(const sequence_mask_options& o) {
  TRISPARSE_EXPECTS_INPUT(
      o.n >= 0 && o.window >= 0 && o.dilation >= 1 && o.global_tokens >= 0 && o.random_per_row >= 0,
      "sequence mask needs n, window, global_tokens, random_per_row >= 0 and "
      "dilation >= 1");
  const std::int64_t n = o.n, g = std::min(o.global_tokens, o.n);
  coo_graph coo;
  coo.rows = coo.cols = n;
  rng r(o.seed);
  const auto add = [&](std::int64_t i, std::int64_t j) {
    if (o.causal && j > i) return;
    coo.src.push_back(i);
    coo.dst.push_back(j);
  };
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t k = -o.window; k <= o.window; ++k) {
      const std::int64_t j = i + k * o.dilation;
      if (j >= 0 && j < n) add(i, j);
    }
    if (i < g) {
      for (std::int64_t j = 0; j < n; ++j) add(i, j);
    } else {
      for (std::int64_t j = 0; j < g; ++j) add(i, j);
    }
    for (std::int64_t k = 0; k < o.random_per_row && n > 0; ++k) {
      const std::int64_t limit = o.causal ? i + 1 : n;
      add(i, static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(limit))));
    }
  }
  return to_csr(coo);
}

csr_graph sliding_window_mask(std::int64_t n, std::int64_t window, bool causal) {
  return generate_sequence_mask({.n = n, .window = window, .causal = causal});
}
csr_graph dilated_mask(std::int64_t n, std::int64_t window, std::int64_t dilation) {
  return generate_sequence_mask({.n = n, .window = window, .dilation = dilation});
}
csr_graph global_mask(std::int64_t n, std::int64_t global_tokens) {
  return generate_sequence_mask({.n = n, .global_tokens = global_tokens});
}
csr_graph bigbird_mask(std::int64_t n, std::int64_t window, std::int64_t global_tokens,
                       std::int64_t random_per_row, std::uint64_t seed) {
  return generate_sequence_mask({.n = n,
                                 .window = window,
                                 .global_tokens = global_tokens,
                                 .random_per_row = random_per_row,
                                 .seed = seed});
}
csr_graph causal_mask(std::int64_t n) {
  return generate_sequence_mask({.n = n, .window = n, .causal = true});
}

void block_mask::check() const {
  if (block < 1) throw invalid_input("block_mask: block size must be >= 1");
  if (rows < 0 || cols < 0) throw invalid_input("block_mask: negative shape");
  if (blocks.rows != (rows + block - 1) / block || blocks.cols != (cols + block - 1) / block) {
    throw invalid_input("block_mask: block pattern is " + std::to_string(blocks.rows) + " x " +
                        std::to_string(blocks.cols) + ", expected ceil(shape / block)");
  }
  blocks.check();
}

csr_graph block_mask::expand() const {
  check();
  csr_graph g;
  g.rows = rows;
  g.cols = cols;
  g.row_ptr.assign(rows + 1, 0);
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t br = i / block;
    std::int64_t count = 0;
    for (std::int64_t e = blocks.row_ptr[br]; e < blocks.row_ptr[br + 1]; ++e) {
      const std::int64_t c0 = std::int64_t{blocks.col_idx[e]} * block;
      count += std::min(cols, c0 + block) - c0;
    }
    g.row_ptr[i + 1] = g.row_ptr[i] + count;
  }
  g.col_idx.resize(g.row_ptr.back());
  for (std::int64_t i = 0; i < rows; ++i) {
    std::int64_t at = g.row_ptr[i];
    const std::int64_t br = i / block;
    for (std::int64_t e = blocks.row_ptr[br]; e < blocks.row_ptr[br + 1]; ++e) {
      const std::int64_t c0 = std::int64_t{blocks.col_idx[e]} * block;
      for (std::int64_t c = c0; c < std::min(cols, c0 + block); ++c)
        g.col_idx[at++] = static_cast<std::int32_t>(c);
    }
  }
  return g;
}

block_mask generate_block_random(const block_random_options& o) {
  TRISPARSE_EXPECTS_INPUT(o.n >= 0 && o.block >= 1, "block_random needs n >= 0 and block >= 1");
  TRISPARSE_EXPECTS_INPUT(o.p >= 0 && o.p <= 1, "block_random needs 0 <= p <= 1");
  block_mask m;
  m.rows = m.cols = o.n;
  m.block = o.block;
  const std::int64_t nb = (o.n + o.block - 1) / o.block;
  m.blocks.rows = m.blocks.cols = nb;
  m.blocks.row_ptr.assign(nb + 1, 0);
  rng r(o.seed);
  for (std::int64_t i = 0; i < nb; ++i) {
    for (std::int64_t j = 0; j < nb; ++j) {
      const bool draw = r.uniform() >= o.p;  // drawn for every cell: same stream whatever the flags
      if (o.causal && j > i) continue;
      if (draw || (o.keep_diagonal && i == j))
        m.blocks.col_idx.push_back(static_cast<std::int32_t>(j));
    }
    m.blocks.row_ptr[i + 1] = static_cast<std::int64_t>(m.blocks.col_idx.size());
  }
  return m;
}

}  // namespace trisparse
