#include "support.hpp"

namespace trisparse {
namespace {

// Patterns of the shapes the issue asks for: N not a multiple of 16, empty rows, rectangular,
// a row with 10^5 nonzeros, the empty matrix, a single row.
std::vector<std::pair<std::string, csr_graph>> shapes() {
  std::vector<std::pair<std::string, csr_graph>> out;
  out.emplace_back("n17", test::random_pattern(17, 17, 6, 1));
  out.emplace_back("n1", test::random_pattern(1, 1, 1, 2));
  out.emplace_back("empty",
                   csr_graph{.rows = 40, .cols = 40, .row_ptr = std::vector<std::int64_t>(41, 0)});
  out.emplace_back("zero_by_zero", csr_graph{});
  out.emplace_back("rect_33x250", test::random_pattern(33, 250, 30, 3));
  out.emplace_back("rect_300x7", test::random_pattern(300, 7, 5, 4));
  out.emplace_back("many_empty_rows", test::random_pattern(1000, 1000, 1, 5));
  out.emplace_back("weighted", test::random_pattern(129, 129, 20, 6, true));
  out.emplace_back("rmat", generate_rmat({.scale = 11, .edge_factor = 8, .seed = 3}));
  coo_graph heavy;
  heavy.rows = 1037;
  heavy.cols = 200003;
  for (std::int64_t j = 0; j < 100000; ++j) {
    heavy.src.push_back(500);
    heavy.dst.push_back(2 * j + 1);
  }
  for (std::int64_t i = 0; i < heavy.rows; i += 3) {
    heavy.src.push_back(i);
    heavy.dst.push_back(i);
  }
  out.emplace_back("row_with_1e5_nonzeros", to_csr(heavy));
  return out;
}

csr_graph pattern_only(csr_graph g) {
  g.values.clear();
  return g;
}

TEST(Formats, BsbRoundTripsExactlyAndChecks) {
  for (const auto& [name, g] : shapes()) {
    for (const int c : {8, 16}) {
      SCOPED_TRACE(name + " 16x" + std::to_string(c));
      const bsb f = build_bsb(g, c);
      EXPECT_NO_THROW(f.check());
      EXPECT_EQ(to_csr(f), pattern_only(g));
      std::int64_t bits = 0;
      for (const auto w : f.bitmap) bits += std::popcount(w);
      EXPECT_EQ(bits, g.nnz());
      for (std::size_t i = 1; i < f.window_order.size(); ++i) {
        EXPECT_GE(f.window_tcbs(f.window_order[i - 1]), f.window_tcbs(f.window_order[i]));
      }
    }
  }
}

TEST(Formats, BsbCompactionUsesTheFewestBlocks) {
  // One window whose 9 rows hit 9 distinct, scattered columns: 2 TCBs of 8 (not 9 column blocks).
  coo_graph c;
  c.rows = 16;
  c.cols = 10000;
  for (int i = 0; i < 9; ++i) {
    c.src.push_back(i);
    c.dst.push_back(1000 * i + 7);
  }
  const bsb f = build_bsb(to_csr(c));
  EXPECT_EQ(f.tcbs(), 2);
  EXPECT_EQ(f.col_idx[8], 8007);
  EXPECT_EQ(f.col_idx[9], bsb::kPadColumn);
}

TEST(Formats, BsbCheckCatchesCorruption) {
  const csr_graph g = generate_rmat({.scale = 9, .edge_factor = 4, .seed = 1});
  const bsb good = build_bsb(g);
  auto broken = [&](auto mutate) {
    bsb f = good;
    mutate(f);
    EXPECT_THROW(f.check(), invalid_input);
  };
  broken([](bsb& f) {
    f.bitmap[0] = 0;
    f.bitmap[1] = 0;
  });                                                                        // empty TCB / column
  broken([](bsb& f) { std::swap(f.col_idx[0], f.col_idx[1]); });             // unsorted slots
  broken([](bsb& f) { f.col_idx[0] = static_cast<std::int32_t>(f.cols); });  // out of range
  broken([](bsb& f) { std::swap(f.window_order.front(), f.window_order.back()); });
  broken([](bsb& f) { f.tcb_offset.pop_back(); });
  broken([](bsb& f) {  // a bit on a padding slot
    for (std::int64_t s = 0; s < static_cast<std::int64_t>(f.col_idx.size()); ++s) {
      if (f.col_idx[s] == bsb::kPadColumn) {
        f.bitmap[(s / 8) * 2] |= std::uint64_t{1} << (s % 8);
        return;
      }
    }
    f.tcb_offset.clear();
  });
}

TEST(Formats, MeBcrsRoundTripsWithValuesAndTheResidueRule) {
  for (const auto& [name, g] : shapes()) {
    for (const int v : {8, 16}) {
      for (const int k : {4, 8}) {
        SCOPED_TRACE(name + " " + std::to_string(v) + "x1 k" + std::to_string(k));
        const me_bcrs f = build_me_bcrs(g, v, k);
        EXPECT_NO_THROW(f.check());
        EXPECT_EQ(to_csr(f, g.has_values()), g);
        EXPECT_LE(f.bytes(), f.sr_bcrs_bytes() + 0);
      }
    }
  }
}

TEST(Formats, MeBcrsLastBlockIsUnpadded) {
  // One window with 11 vectors at k = 8: a full block of 8 and a residue block of 3, no padding.
  coo_graph c;
  c.rows = 8;
  c.cols = 100;
  for (int j = 0; j < 11; ++j) {
    c.src.push_back(j % 8);
    c.dst.push_back(j * 9);
    c.values.push_back(static_cast<float>(j + 1));
  }
  const me_bcrs f = build_me_bcrs(to_csr(c), 8, 8);
  EXPECT_EQ(f.vectors(), 11);
  EXPECT_EQ(f.values.size(), 88u);
  // Vector 9 (second in the residue block) at row 1: 64 + 1 * 3 + 1.
  EXPECT_EQ(f.value_index(0, 9, 1), 68);
  EXPECT_EQ(f.values[68], 10.0f);
}

TEST(Formats, BcsrRoundTripsAndUsesTheRowInterleavedLayout) {
  for (const auto& [name, g] : shapes()) {
    if (g.nnz() > 20000) continue;  // values are G*G per block: keep the dense storage small
    for (const std::int64_t b : {1, 2, 7, 16, 64}) {
      SCOPED_TRACE(name + " G" + std::to_string(b));
      const bcsr f = build_bcsr(g, b);
      EXPECT_NO_THROW(f.check());
      EXPECT_EQ(to_csr(f, g.has_values()), g);
      EXPECT_EQ(build_bcsr(blocks_of(g, b)).col_idx, f.col_idx);
    }
  }
  // Block row 0 holding blocks (0,0) and (0,2) at G = 2: row t=1 of block j=1 starts at t*nb*G +
  // j*G.
  coo_graph c;
  c.rows = c.cols = 6;
  c.src = {1, 0};
  c.dst = {5, 0};
  c.values = {3.0f, 4.0f};
  const bcsr f = build_bcsr(to_csr(c), 2);
  ASSERT_EQ(f.blocks(), 2);
  EXPECT_EQ(f.value_index(0, 1, 1, 1), 1 * 2 * 2 + 1 * 2 + 1);
  EXPECT_EQ(f.values[7], 3.0f);
  EXPECT_EQ(f.values[0], 4.0f);
}

TEST(Formats, BlockMaskExpandsToWholeBlocks) {
  const block_mask m = generate_block_random({.n = 70, .p = 0.5, .block = 16, .seed = 2});
  const bcsr f = build_bcsr(m);
  EXPECT_TRUE(f.values.empty());
  EXPECT_EQ(to_csr(f), m.expand());
}

TEST(Formats, StatsMatchHandCounts) {
  // Two windows: window 0 with 1 TCB of 3 nonzeros, window 1 with 3 TCBs of 1 nonzero each.
  coo_graph c;
  c.rows = 32;
  c.cols = 64;
  c.src = {0, 1, 2, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
  c.dst = {0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  const csr_graph g = to_csr(c);
  const bsb_stats s = compute_stats(build_bsb(g), g.nnz());
  EXPECT_EQ(s.tcbs, 4);
  EXPECT_DOUBLE_EQ(s.tcb_per_window_mean, 2.0);
  EXPECT_DOUBLE_EQ(s.tcb_per_window_cv, 0.5);
  EXPECT_DOUBLE_EQ(s.nnz_per_tcb_mean, 21.0 / 4);
  EXPECT_EQ(s.max_tcbs_in_window, 3);
  const auto fp = table3_footprints(g);
  EXPECT_EQ(fp.front().format, "CSR");
  EXPECT_EQ(fp.front().bytes, 4 * (32 + 2 * 21));
  EXPECT_EQ(fp.back().format, "BSB");
  EXPECT_EQ(fp.back().bytes, (32 * (2 + 4 * 8) + 4 * 16 * 8) / 8);
}

}  // namespace
}  // namespace trisparse
