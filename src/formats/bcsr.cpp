#include "trisparse/formats/bcsr.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "trisparse/core/error.hpp"

namespace trisparse {

namespace {
[[noreturn]] void broken(const std::string& why) {
  throw invalid_input("bcsr invariant broken: " + why);
}
}  // namespace

std::int64_t bcsr::bytes() const {
  return static_cast<std::int64_t>(8 * row_ptr.size() + 4 * col_idx.size() + 4 * values.size());
}

bcsr_view bcsr::view() const {
  return {rows,           cols,           block,
          block_rows(),   block_cols(),   blocks(),
          row_ptr.data(), col_idx.data(), values.empty() ? nullptr : values.data()};
}

block_mask blocks_of(const csr_graph& g, std::int64_t block) {
  g.check();
  TRISPARSE_EXPECTS_INPUT(block >= 1 && block <= 1024, "BCSR block size must be in [1, 1024]");
  block_mask m;
  m.rows = g.rows;
  m.cols = g.cols;
  m.block = block;
  const std::int64_t brows = (g.rows + block - 1) / block;
  m.blocks.rows = brows;
  m.blocks.cols = (g.cols + block - 1) / block;
  std::vector<std::vector<std::int32_t>> cols(brows);
#pragma omp parallel for schedule(dynamic, 16)
  for (std::int64_t b = 0; b < brows; ++b) {
    auto& c = cols[b];
    for (std::int64_t r = b * block; r < std::min(g.rows, (b + 1) * block); ++r) {
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
        if (!g.has_values() || g.values[e] != 0.0f)
          c.push_back(static_cast<std::int32_t>(g.col_idx[e] / block));
      }
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  m.blocks.row_ptr.assign(brows + 1, 0);
  for (std::int64_t b = 0; b < brows; ++b)
    m.blocks.row_ptr[b + 1] = m.blocks.row_ptr[b] + static_cast<std::int64_t>(cols[b].size());
  m.blocks.col_idx.reserve(m.blocks.row_ptr.back());
  for (const auto& c : cols) m.blocks.col_idx.insert(m.blocks.col_idx.end(), c.begin(), c.end());
  return m;
}

bcsr build_bcsr(const csr_graph& g, std::int64_t block) {
  bcsr f = build_bcsr(blocks_of(g, block));
  f.values.assign(f.blocks() * block * block, 0.0f);
#pragma omp parallel for schedule(dynamic, 16)
  for (std::int64_t b = 0; b < f.block_rows(); ++b) {
    const auto c0 = f.col_idx.begin() + f.row_ptr[b], c1 = f.col_idx.begin() + f.row_ptr[b + 1];
    for (std::int64_t r = b * block; r < std::min(g.rows, (b + 1) * block); ++r) {
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
        const float x = g.has_values() ? g.values[e] : 1.0f;
        if (x == 0.0f) continue;
        const std::int64_t j = std::lower_bound(c0, c1, g.col_idx[e] / block) - c0;
        f.values[f.value_index(b, j, r - b * block, g.col_idx[e] % block)] = x;
      }
    }
  }
  return f;
}

bcsr build_bcsr(const block_mask& mask) {
  mask.check();
  bcsr f;
  f.rows = mask.rows;
  f.cols = mask.cols;
  f.block = mask.block;
  f.row_ptr = mask.blocks.row_ptr;
  f.col_idx = mask.blocks.col_idx;
  return f;
}

void bcsr::check() const {
  if (block < 1) broken("block < 1");
  if (rows < 0 || cols < 0) broken("negative shape");
  if (block_rows() != (rows + block - 1) / block) broken("block row count does not match rows");
  if (row_ptr.front() != 0 || row_ptr.back() != blocks()) broken("row_ptr does not span col_idx");
  if (!values.empty() && static_cast<std::int64_t>(values.size()) != blocks() * block * block) {
    broken("values size != blocks * block * block");
  }
  for (std::int64_t b = 0; b < block_rows(); ++b) {
    if (row_ptr[b + 1] < row_ptr[b]) broken("row_ptr decreases at block row " + std::to_string(b));
    for (std::int64_t e = row_ptr[b]; e < row_ptr[b + 1]; ++e) {
      if (col_idx[e] < 0 || col_idx[e] >= block_cols())
        broken("block column " + std::to_string(col_idx[e]) + " out of range");
      if (e > row_ptr[b] && col_idx[e] <= col_idx[e - 1])
        broken("block columns not increasing in block row " + std::to_string(b));
    }
    if (values.empty()) continue;
    const std::int64_t nb = row_ptr[b + 1] - row_ptr[b];
    for (std::int64_t t = 0; t < block; ++t) {
      for (std::int64_t j = 0; j < nb; ++j) {
        for (std::int64_t c = 0; c < block; ++c) {
          const float x = values[value_index(b, j, t, c)];
          if (!std::isfinite(x)) broken("non-finite value");
          if (x != 0.0f && (b * block + t >= rows ||
                            std::int64_t{col_idx[row_ptr[b] + j]} * block + c >= cols)) {
            broken("value outside the matrix in block row " + std::to_string(b));
          }
        }
      }
    }
  }
}

csr_graph to_csr(const bcsr& f, bool with_values) {
  if (f.values.empty()) {
    block_mask m;
    m.rows = f.rows;
    m.cols = f.cols;
    m.block = f.block;
    m.blocks.rows = f.block_rows();
    m.blocks.cols = f.block_cols();
    m.blocks.row_ptr = f.row_ptr;
    m.blocks.col_idx = f.col_idx;
    return m.expand();
  }
  csr_graph g;
  g.rows = f.rows;
  g.cols = f.cols;
  g.row_ptr.assign(f.rows + 1, 0);
  for (std::int64_t i = 0; i < f.rows; ++i) {
    const std::int64_t b = i / f.block, t = i % f.block, nb = f.row_ptr[b + 1] - f.row_ptr[b];
    for (std::int64_t j = 0; j < nb; ++j) {
      for (std::int64_t c = 0; c < f.block; ++c) {
        const float x = f.values[f.value_index(b, j, t, c)];
        if (x == 0.0f) continue;
        g.col_idx.push_back(
            static_cast<std::int32_t>(std::int64_t{f.col_idx[f.row_ptr[b] + j]} * f.block + c));
        if (with_values) g.values.push_back(x);
      }
    }
    g.row_ptr[i + 1] = g.nnz();
  }
  return g;
}

}  // namespace trisparse
