// The row-interleaved layout of the blocked-sparse report's pipeline (an internal host builder;
// the kernels that read it run on the GPU): block rows in mask order with each mask head's scores
// packed without gaps, every score in exactly one SDDMM tile, every query row in exactly one SpMM
// tile and one softmax part, parts of about equal weight.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <vector>

#include "../../src/cuda/formats/interleaved_layout.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse {
namespace {

namespace il = cuda::interleaved;

void expect_layout(const block_sparse_mask& mask) {
  SCOPED_TRACE("G " + std::to_string(mask.block) + " causal " + std::to_string(mask.causal) +
               " mask heads " + std::to_string(mask.heads));
  const il::layout l = il::make_layout(mask);
  const std::int64_t g = mask.block;
  const int r_sddmm = l.sddmm_rows, rows_spmm = il::kSpmmThreadRows * l.spmm_rows_per_thread;
  EXPECT_TRUE(r_sddmm <= std::min<std::int64_t>(g, 32) &&
              2 * r_sddmm > std::min<std::int64_t>(g, 32));
  ASSERT_EQ(l.sddmm_first.size(), static_cast<std::size_t>(mask.heads + 1));
  ASSERT_EQ(l.spmm_first.size(), l.sddmm_first.size());
  ASSERT_EQ(l.softmax_first.size(), l.sddmm_first.size());
  std::size_t i = 0;
  std::int64_t most = 0;
  for (std::int64_t m = 0; m < mask.heads; ++m) {
    const std::size_t head_begin = i;
    std::int64_t values = 0, query_rows = 0, max_weight = 0;
    for (std::int64_t b = 0; b < mask.batch(); ++b) {
      const csr_graph& blocks = mask.masks[static_cast<std::size_t>(b * mask.heads + m)].blocks;
      for (std::int64_t rb = 0; rb < blocks.rows; ++rb, ++i) {
        ASSERT_LT(i, l.rows.size());
        const il::block_row& r = l.rows[i];
        EXPECT_EQ(r.seq, b);
        EXPECT_EQ(r.mask_head, m);
        EXPECT_EQ(r.row0, rb * g);
        EXPECT_EQ(r.rows, std::min(g, mask.len_q(b) - rb * g));
        EXPECT_EQ(r.value0, values);
        ASSERT_EQ(r.count, blocks.row_ptr[rb + 1] - blocks.row_ptr[rb]);
        for (std::int32_t c = 0; c < r.count; ++c)
          EXPECT_EQ(l.col_idx[static_cast<std::size_t>(r.first + c)],
                    blocks.col_idx[static_cast<std::size_t>(blocks.row_ptr[rb] + c)]);
        values += std::int64_t{r.rows} * r.count * g;
        query_rows += r.rows;
        max_weight = std::max(max_weight, std::int64_t{r.count} * g + 64);
      }
    }
    most = std::max(most, values);
    // SDDMM tiles of this head: distinct, aligned, inside their block row, covering every score.
    std::set<std::tuple<std::int32_t, std::int32_t, std::int32_t>> seen;
    std::int64_t covered = 0;
    for (std::int32_t x = l.sddmm_first[m]; x < l.sddmm_first[m + 1]; ++x) {
      const il::tile t = l.sddmm[static_cast<std::size_t>(x)];
      const il::block_row& r = l.rows[static_cast<std::size_t>(t.row)];
      const std::int64_t width = std::int64_t{r.count} * g, per = il::kSddmmCoords / r_sddmm;
      ASSERT_EQ(r.mask_head, m);
      ASSERT_TRUE(t.t0 % r_sddmm == 0 && t.t0 < r.rows && t.p0 % per == 0 && t.p0 < width);
      EXPECT_TRUE(seen.insert({t.row, t.t0, t.p0}).second) << "a tile twice";
      covered += std::min<std::int64_t>(r_sddmm, r.rows - t.t0) * std::min(per, width - t.p0);
    }
    EXPECT_EQ(covered, values);
    // SpMM tiles: every query row of the head once.
    std::int64_t spmm_rows = 0;
    std::set<std::pair<std::int32_t, std::int32_t>> spmm_seen;
    for (std::int32_t x = l.spmm_first[m]; x < l.spmm_first[m + 1]; ++x) {
      const il::tile t = l.spmm[static_cast<std::size_t>(x)];
      const il::block_row& r = l.rows[static_cast<std::size_t>(t.row)];
      ASSERT_EQ(r.mask_head, m);
      ASSERT_TRUE(t.t0 % rows_spmm == 0 && t.t0 < r.rows);
      EXPECT_TRUE(spmm_seen.insert({t.row, t.t0}).second);
      spmm_rows += std::min(rows_spmm, r.rows - t.t0);
    }
    EXPECT_EQ(spmm_rows, query_rows);
    // Softmax parts: ascending, the first at the head's first row, each ending where the next
    // (or the sentinel) starts, at most kMaxParts, none much heavier than an even share.
    const std::int32_t p0 = l.softmax_first[m], p1 = l.softmax_first[m + 1];
    if (query_rows == 0) {
      EXPECT_EQ(p0, p1);
      continue;
    }
    ASSERT_GT(p1, p0);
    EXPECT_LE(p1 - p0, il::kMaxParts);
    EXPECT_EQ(l.parts[static_cast<std::size_t>(p0)].row, static_cast<std::int32_t>(head_begin));
    EXPECT_EQ(l.parts[static_cast<std::size_t>(p0)].t, 0);
    std::int64_t total = 0;
    for (std::size_t x = head_begin; x < i; ++x)
      total += std::int64_t{l.rows[x].rows} * (std::int64_t{l.rows[x].count} * g + 64);
    std::int64_t rows_in_parts = 0;
    for (std::int32_t x = p0; x < p1; ++x) {
      il::part at = l.parts[static_cast<std::size_t>(x)];
      const il::part end = l.parts[static_cast<std::size_t>(x) + 1];
      ASSERT_TRUE(std::tie(at.row, at.t) < std::tie(end.row, end.t)) << "an empty part";
      std::int64_t weight = 0;
      while (std::tie(at.row, at.t) < std::tie(end.row, end.t)) {
        const il::block_row& r = l.rows[static_cast<std::size_t>(at.row)];
        weight += std::int64_t{r.count} * g + 64;
        ++rows_in_parts;
        if (++at.t == r.rows) {
          ++at.row;
          at.t = 0;
        }
      }
      EXPECT_LE(weight, total / (p1 - p0) + max_weight + 1);
    }
    EXPECT_EQ(rows_in_parts, query_rows);
  }
  EXPECT_EQ(i, l.rows.size());
  EXPECT_EQ(l.slot, most);
  EXPECT_EQ(l.parts.back().row, static_cast<std::int32_t>(l.rows.size()));
  EXPECT_EQ(l.parts.back().t, 0);
}

TEST(InterleavedLayout, CoversEveryScoreOnce) {
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64, 2000};
  std::uint64_t seed = 1;
  for (const std::int64_t g : {1, 2, 3, 8, 16, 24, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      for (const std::int64_t heads : {1, 3}) {
        expect_layout(make_block_sparse_mask({.layout = block_layout::random,
                                              .block = g,
                                              .p = 0.6,
                                              .causal = causal,
                                              .heads = heads,
                                              .seed = seed++},
                                             lens));
      }
    }
  }
  // More query rows than parts (20,000 rows at G = 1), a dense mask, and no keys at all.
  expect_layout(
      make_block_sparse_mask({.layout = block_layout::random, .block = 1, .p = 0.999, .seed = 7},
                             std::vector<std::int64_t>{20000}));
  expect_layout(make_block_sparse_mask({.layout = block_layout::dense, .block = 64},
                                       std::vector<std::int64_t>{1000, 3}));
  block_sparse_mask rect = make_block_sparse_mask({.layout = block_layout::dense, .block = 16},
                                                  std::vector<std::int64_t>{0});
  expect_layout(rect);
}

}  // namespace
}  // namespace trisparse
