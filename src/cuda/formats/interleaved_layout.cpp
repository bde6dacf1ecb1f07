// The row-interleaved BCSR layout and the three kernels' work lists (host code).
#include "interleaved_layout.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "trisparse/core/error.hpp"

namespace trisparse::cuda::interleaved {

namespace {

std::int32_t narrow(std::int64_t x, const char* what) {
  if (x > std::numeric_limits<std::int32_t>::max())
    throw invalid_input(std::string("block-sparse pipeline: ") + what + " exceeds 2^31 - 1");
  return static_cast<std::int32_t>(x);
}

std::int32_t size_of(std::size_t n, const char* what) {
  return narrow(static_cast<std::int64_t>(n), what);
}

// Splits the rows of one mask head (block rows [row_begin, row_end)) into at most kMaxParts
// parts of about equal weight (a row's positions plus a fixed cost per row).
void add_parts(const std::vector<block_row>& rows, std::size_t row_begin, std::size_t row_end,
               std::int64_t g, std::vector<part>& parts) {
  const auto row_weight = [&](const block_row& r) { return std::int64_t{r.count} * g + 64; };
  std::int64_t weight = 0, count = 0;
  for (std::size_t i = row_begin; i < row_end; ++i) {
    weight += std::int64_t{rows[i].rows} * row_weight(rows[i]);
    count += rows[i].rows;
  }
  if (count == 0) return;
  const std::int64_t n = std::min(count, kMaxParts);
  std::int64_t seen = 0, next = 0;
  for (std::size_t i = row_begin; i < row_end; ++i) {
    for (std::int32_t t = 0; t < rows[i].rows; ++t) {
      // Part `next` starts at the first row whose preceding weight reaches next / n of the total.
      if (next < n && seen * n >= next * weight) {
        parts.push_back({size_of(i, "the block rows"), t});
        ++next;
      }
      seen += row_weight(rows[i]);
    }
  }
}

}  // namespace

int sddmm_rows_for(std::int64_t block) {
  int r = 1;
  while (r * 2 <= std::min<std::int64_t>(block, 32)) r *= 2;
  return r;
}

int spmm_rows_per_thread_for(std::int64_t block) { return block <= 8 ? 1 : block <= 16 ? 2 : 4; }

layout make_layout(const block_sparse_mask& mask) {
  layout l;
  const std::int64_t g = mask.block;
  l.sddmm_rows = sddmm_rows_for(g);
  l.spmm_rows_per_thread = spmm_rows_per_thread_for(g);
  const std::int64_t sddmm_width = kSddmmCoords / l.sddmm_rows;
  const std::int32_t spmm_rows = kSpmmThreadRows * l.spmm_rows_per_thread;
  for (std::int64_t m = 0; m < mask.heads; ++m) {
    l.sddmm_first.push_back(size_of(l.sddmm.size(), "the tiles"));
    l.spmm_first.push_back(size_of(l.spmm.size(), "the tiles"));
    l.softmax_first.push_back(size_of(l.parts.size(), "the parts"));
    const std::size_t row_begin = l.rows.size();
    std::int64_t values = 0;
    for (std::int64_t b = 0; b < mask.batch(); ++b) {
      const csr_graph& blocks = mask.masks[static_cast<std::size_t>(b * mask.heads + m)].blocks;
      const std::int64_t lq = mask.len_q(b);
      narrow(std::max(lq, mask.len_k(b)) + 2 * g, "a sequence length");
      for (std::int64_t rb = 0; rb < blocks.rows; ++rb) {
        block_row r{};
        r.first = static_cast<std::int64_t>(l.col_idx.size());
        r.value0 = values;
        r.seq = narrow(b, "the batch");
        r.row0 = narrow(rb * g, "a sequence length");
        r.rows = narrow(std::min(g, lq - rb * g), "the block");
        r.count = narrow(blocks.row_ptr[rb + 1] - blocks.row_ptr[rb], "the blocks of a row");
        r.mask_head = narrow(m, "the heads");
        l.col_idx.insert(l.col_idx.end(), blocks.col_idx.begin() + blocks.row_ptr[rb],
                         blocks.col_idx.begin() + blocks.row_ptr[rb + 1]);
        const std::int64_t width = std::int64_t{r.count} * g;
        narrow(width, "a row's kept keys");
        values += std::int64_t{r.rows} * width;
        const std::int32_t row = size_of(l.rows.size(), "the block rows");
        for (std::int32_t t0 = 0; t0 < r.rows; t0 += l.sddmm_rows)
          for (std::int64_t p0 = 0; p0 < width; p0 += sddmm_width)
            l.sddmm.push_back({row, t0, static_cast<std::int32_t>(p0)});
        for (std::int32_t t0 = 0; t0 < r.rows; t0 += spmm_rows) l.spmm.push_back({row, t0, 0});
        l.rows.push_back(r);
      }
    }
    add_parts(l.rows, row_begin, l.rows.size(), g, l.parts);
    l.slot = std::max(l.slot, values);
  }
  l.sddmm_first.push_back(size_of(l.sddmm.size(), "the tiles"));
  l.spmm_first.push_back(size_of(l.spmm.size(), "the tiles"));
  l.softmax_first.push_back(size_of(l.parts.size(), "the parts"));
  l.parts.push_back({size_of(l.rows.size(), "the block rows"), 0});
  return l;
}

}  // namespace trisparse::cuda::interleaved
