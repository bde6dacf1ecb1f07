// Block-sparse attention masks: checks, expansion to elements, the layout builders.
#include "trisparse/formats/block_sparse.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>

#include "block_sparse_internal.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/random.hpp"

namespace trisparse {

namespace {

void check_offsets(const std::vector<std::int64_t>& cu, const char* name) {
  TRISPARSE_EXPECTS_INPUT(!cu.empty() && cu.front() == 0,
                          std::string("block_sparse_mask: ") + name + " must start at 0");
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    TRISPARSE_EXPECTS_INPUT(cu[b] <= cu[b + 1], std::string("block_sparse_mask: ") + name +
                                                    " decreases at sequence " + std::to_string(b));
  }
}

}  // namespace

std::int64_t block_sparse_mask::active_blocks() const {
  std::int64_t n = 0;
  for (const block_mask& m : masks) n += m.blocks.nnz();
  return n;
}

double block_sparse_mask::density() const {
  std::int64_t all = 0;
  for (const block_mask& m : masks) all += m.blocks.rows * m.blocks.cols;
  return all == 0 ? 0.0 : static_cast<double>(active_blocks()) / static_cast<double>(all);
}

void block_sparse_mask::check() const {
  TRISPARSE_EXPECTS_INPUT(block >= 1, "block_sparse_mask: block must be >= 1");
  TRISPARSE_EXPECTS_INPUT(heads >= 1, "block_sparse_mask: heads must be >= 1");
  check_offsets(cu_seqlens_q, "cu_seqlens_q");
  check_offsets(cu_seqlens_k, "cu_seqlens_k");
  TRISPARSE_EXPECTS_INPUT(cu_seqlens_q.size() == cu_seqlens_k.size(),
                          "block_sparse_mask: cu_seqlens_q and cu_seqlens_k have " +
                              std::to_string(cu_seqlens_q.size()) + " and " +
                              std::to_string(cu_seqlens_k.size()) + " offsets");
  TRISPARSE_EXPECTS_INPUT(static_cast<std::int64_t>(masks.size()) == batch() * heads,
                          "block_sparse_mask: " + std::to_string(masks.size()) + " masks for " +
                              std::to_string(batch()) + " sequences x " + std::to_string(heads) +
                              " heads");
  for (std::int64_t b = 0; b < batch(); ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const block_mask& m = masks[b * heads + h];
      const std::string where =
          "block_sparse_mask: sequence " + std::to_string(b) + ", head " + std::to_string(h);
      TRISPARSE_EXPECTS_INPUT(m.block == block, where + " has block " + std::to_string(m.block) +
                                                    ", not " + std::to_string(block));
      TRISPARSE_EXPECTS_INPUT(m.rows == len_q(b) && m.cols == len_k(b),
                              where + " is " + std::to_string(m.rows) + " x " +
                                  std::to_string(m.cols) + ", the sequence " +
                                  std::to_string(len_q(b)) + " x " + std::to_string(len_k(b)));
      m.check();
    }
  }
}

csr_graph block_sparse_mask::expand(std::int64_t b, std::int64_t h) const {
  csr_graph g = at(b, h).expand();
  if (!causal) return g;
  csr_graph c;
  c.rows = g.rows;
  c.cols = g.cols;
  c.row_ptr.assign(g.rows + 1, 0);
  for (std::int64_t i = 0; i < g.rows; ++i) {
    const std::int64_t last = last_key(b, i);
    for (std::int64_t e = g.row_ptr[i]; e < g.row_ptr[i + 1]; ++e) {
      if (g.col_idx[e] <= last) c.col_idx.push_back(g.col_idx[e]);
    }
    c.row_ptr[i + 1] = static_cast<std::int64_t>(c.col_idx.size());
  }
  return c;
}

namespace {

// The layout's blocks of one n x n mask (nb x nb blocks), rows sorted.
block_mask layout_mask(const block_layout_options& o, std::int64_t n, rng& r) {
  block_mask m;
  m.rows = m.cols = n;
  m.block = o.block;
  const std::int64_t nb = (n + o.block - 1) / o.block;
  m.blocks.rows = m.blocks.cols = nb;
  m.blocks.row_ptr.assign(nb + 1, 0);
  std::vector<char> keep(static_cast<std::size_t>(nb));
  // random: a cell is kept when its draw (53 bits, as rng::uniform) is at least p * 2^53.
  const auto threshold = static_cast<std::uint64_t>(std::ceil(o.p * 0x1.0p53));
  if (o.layout == block_layout::random) {
    m.blocks.col_idx.reserve(static_cast<std::size_t>(
        static_cast<double>(nb) * static_cast<double>(nb) * (1 - o.p) + static_cast<double>(nb)));
  }
  for (std::int64_t i = 0; i < nb; ++i) {
    const std::int64_t last = o.causal ? i : nb - 1;  // square: block j has a key <= i iff j <= i
    if (o.layout == block_layout::random) {
      // Drawn for every cell: one stream whatever causal.
      for (std::int64_t j = 0; j < nb; ++j) {
        if (((r.next() >> 11) >= threshold || i == j) && j <= last)
          m.blocks.col_idx.push_back(static_cast<std::int32_t>(j));
      }
      m.blocks.row_ptr[i + 1] = static_cast<std::int64_t>(m.blocks.col_idx.size());
      continue;
    }
    for (std::int64_t j = 0; j < nb; ++j) {
      bool k = false;
      switch (o.layout) {
        case block_layout::dense:
          k = true;
          break;
        case block_layout::random:  // above
          break;
        case block_layout::window:
          k = std::abs(i - j) <= o.window;
          break;
        case block_layout::strided:
          k = (i - j) % o.stride == 0;
          break;
        case block_layout::global:
          k = i < o.global || j < o.global || i == j;
          break;
        case block_layout::bigbird:
          k = std::abs(i - j) <= o.window || i < o.global || j < o.global;
          break;
      }
      keep[static_cast<std::size_t>(j)] = static_cast<char>(k);
    }
    if (o.layout == block_layout::bigbird) {
      // `random` distinct key blocks among those the row may use (fewer if fewer are left).
      std::int64_t free = 0;
      for (std::int64_t j = 0; j <= last; ++j) free += keep[static_cast<std::size_t>(j)] == 0;
      for (std::int64_t t = 0; t < std::min(o.random, free); ++t) {
        auto pick = static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(free - t)));
        for (std::int64_t j = 0; j <= last; ++j) {
          if (keep[static_cast<std::size_t>(j)] == 0 && pick-- == 0) {
            keep[static_cast<std::size_t>(j)] = 1;
            break;
          }
        }
      }
    }
    for (std::int64_t j = 0; j <= last; ++j) {
      if (keep[static_cast<std::size_t>(j)] != 0)
        m.blocks.col_idx.push_back(static_cast<std::int32_t>(j));
    }
    m.blocks.row_ptr[i + 1] = static_cast<std::int64_t>(m.blocks.col_idx.size());
  }
  return m;
}

}  // namespace

block_sparse_mask make_block_sparse_mask(const block_layout_options& o,
                                         std::span<const std::int64_t> seq_lens) {
  TRISPARSE_EXPECTS_INPUT(o.block >= 1 && o.heads >= 1,
                          "block-sparse mask: block and heads must be >= 1");
  TRISPARSE_EXPECTS_INPUT(o.p >= 0 && o.p <= 1, "block-sparse mask: p must lie in [0, 1]");
  TRISPARSE_EXPECTS_INPUT(o.stride >= 1, "block-sparse mask: stride must be >= 1");
  TRISPARSE_EXPECTS_INPUT(o.window >= 0 && o.global >= 0 && o.random >= 0,
                          "block-sparse mask: window, global and random must be >= 0");
  block_sparse_mask mask;
  mask.block = o.block;
  mask.heads = o.heads;
  mask.causal = o.causal;
  for (const std::int64_t len : seq_lens) {
    TRISPARSE_EXPECTS_INPUT(len >= 0, "block-sparse mask: negative sequence length");
    mask.cu_seqlens_q.push_back(mask.cu_seqlens_q.back() + len);
  }
  mask.cu_seqlens_k = mask.cu_seqlens_q;
  // Each (sequence, head) its own stream: per-head masks differ, adding a sequence does not
  // change the others, and the masks are drawn in parallel with the same result.
  const std::int64_t count = mask.batch() * o.heads;
  mask.masks.resize(static_cast<std::size_t>(count));
  std::exception_ptr failed;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t x = 0; x < count; ++x) {
    try {
      rng r(o.seed + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(x + 1));
      mask.masks[static_cast<std::size_t>(x)] = layout_mask(o, mask.len_q(x / o.heads), r);
    } catch (...) {  // out of memory: rethrown below, not out of the parallel region
#pragma omp critical
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  return mask;
}

namespace detail {

std::int64_t attended_pairs(const block_sparse_mask& m) {
  std::int64_t n = 0;
  const std::int64_t g = m.block;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    const std::int64_t lq = m.len_q(b);
    for (std::int64_t h = 0; h < m.heads; ++h) {
      const csr_graph& blocks = m.masks[b * m.heads + h].blocks;
      for (std::int64_t r = 0; r < blocks.rows; ++r) {
        for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          for (std::int64_t i = r * g; i < std::min(lq, (r + 1) * g); ++i) {
            n += std::max<std::int64_t>(0, std::min(j0 + g, m.last_key(b, i) + 1) - j0);
          }
        }
      }
    }
  }
  return n;
}

csr_graph batch_pattern(const block_sparse_mask& m, std::int64_t h) {
  csr_graph g;
  g.rows = m.cu_seqlens_q.back();
  g.cols = m.cu_seqlens_k.back();
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    const csr_graph e = m.expand(b, h);
    const auto col0 = static_cast<std::int32_t>(m.cu_seqlens_k[b]);
    for (std::int64_t r = 0; r < e.rows; ++r) {
      for (std::int64_t x = e.row_ptr[r]; x < e.row_ptr[r + 1]; ++x)
        g.col_idx.push_back(col0 + e.col_idx[x]);
      g.row_ptr.push_back(g.nnz());
    }
  }
  return g;
}

std::pair<std::int64_t, std::int64_t> most_blocks(const block_sparse_mask& m) {
  std::int64_t lq = 0, lk = 0;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    lq = std::max(lq, m.len_q(b));
    lk = std::max(lk, m.len_k(b));
  }
  return {(lq + m.block - 1) / m.block, (lk + m.block - 1) / m.block};
}

block_mask empty_block_mask(std::int64_t lq, std::int64_t lk, std::int64_t g) {
  block_mask m;
  m.rows = lq;
  m.cols = lk;
  m.block = g;
  m.blocks.rows = (lq + g - 1) / g;
  m.blocks.cols = (lk + g - 1) / g;
  m.blocks.row_ptr.assign(1, 0);
  return m;
}

block_sparse_mask topk_rows(const block_sparse_mask& shape, std::int64_t slots, bool fill_past) {
  block_sparse_mask m = shape;
  m.masks.clear();
  const std::int64_t g = shape.block;
  for (std::int64_t b = 0; b < shape.batch(); ++b) {
    const std::int64_t lq = shape.len_q(b), lk = shape.len_k(b);
    const std::int64_t nbq = (lq + g - 1) / g, nbk = (lk + g - 1) / g;
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      block_mask bm = empty_block_mask(lq, lk, g);
      for (std::int64_t r = 0; r < nbq; ++r) {
        const std::int64_t last = shape.last_key(b, std::min(lq, (r + 1) * g) - 1);
        const std::int64_t allowed = last < 0 ? 0 : last / g + 1;
        for (std::int64_t i = 0; i < slots; ++i) {
          if (i < allowed)
            bm.blocks.col_idx.push_back(static_cast<std::int32_t>(i));
          else if (fill_past)
            bm.blocks.col_idx.push_back(static_cast<std::int32_t>(nbk));
        }
        bm.blocks.row_ptr.push_back(bm.blocks.nnz());
      }
      m.masks.push_back(std::move(bm));
    }
  }
  return m;
}

}  // namespace detail

}  // namespace trisparse
