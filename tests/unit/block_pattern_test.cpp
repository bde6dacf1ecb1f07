// block_pattern: its checks, statistics, union, conversion to a mask, and its file (round trip and
// the errors a damaged file gives); a learner's tracked step (importance_fold.hpp) on the CPU.
#include "trisparse/formats/block_pattern.hpp"

#include "trisparse/formats/bcsr.hpp"
#include "trisparse/ops/importance_fold.hpp"
#include "trisparse/ops/pattern_learn.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>

#include "../files.hpp"

namespace trisparse {
namespace {

// A 2-head pattern over 4 x 4 blocks of 16 (rows 60: the last block row is partial).
block_pattern small_pattern() {
  block_pattern p;
  p.block = 16;
  p.rows = p.cols = 60;
  csr_graph a{4, 4, {0, 1, 3, 4, 6}, {0, 0, 1, 2, 0, 3}, {}};  // 6 of 16
  csr_graph b{4, 4, {0, 1, 2, 3, 4}, {0, 1, 2, 3}, {}};        // the diagonal
  p.heads = {a, b};
  p.made_by = "by hand";
  return p;
}

std::vector<char> file_bytes(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::filesystem::path& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(BlockPattern, StatsOfAKnownPattern) {
  const block_pattern_stats s = stats(small_pattern());
  ASSERT_EQ(s.density.size(), 2u);
  EXPECT_DOUBLE_EQ(s.density[0], 6.0 / 16);
  EXPECT_DOUBLE_EQ(s.density[1], 4.0 / 16);
  EXPECT_DOUBLE_EQ(s.row_min_density[0], 0.25);
  EXPECT_DOUBLE_EQ(s.row_max_density[0], 0.5);
  // Head 0's |r - c|: 0, 1, 0, 0, 3, 0 over 6 blocks, over 4 block rows.
  EXPECT_DOUBLE_EQ(s.mean_distance[0], 4.0 / 6 / 4);
  EXPECT_DOUBLE_EQ(s.mean_distance[1], 0.0);
  // Common blocks: (0,0), (1,1), (2,2), (3,3) -> 4 of 6 + 4 - 4 = 6.
  EXPECT_DOUBLE_EQ(s.head_overlap, 4.0 / 6);
}

TEST(BlockPattern, CheckNamesWhatIsBroken) {
  block_pattern p = small_pattern();
  p.heads[0].col_idx = {0, 1, 0, 2, 0, 3};  // block row 1 lists 1 then 0
  EXPECT_THROW(
      {
        try {
          p.check();
        } catch (const invalid_input& e) {
          EXPECT_NE(std::string(e.what()).find("head 0"), std::string::npos);
          EXPECT_NE(std::string(e.what()).find("strictly increasing"), std::string::npos);
          throw;
        }
      },
      invalid_input);
  p = small_pattern();
  p.order = {0, 1, 2};
  EXPECT_THROW(p.check(), invalid_input);
  p.order.resize(60);
  std::iota(p.order.begin(), p.order.end(), 0);
  p.order[5] = 4;  // 4 twice
  EXPECT_THROW(p.check(), invalid_input);
  p = small_pattern();
  p.heads[1].cols = 5;
  EXPECT_THROW(p.check(), invalid_input);
}

TEST(BlockPattern, LayoutsUnionsAndMasks) {
  block_layout_options o;
  o.block = 64;
  o.layout = block_layout::window;
  o.window = 1;
  const block_pattern window = layout_block_pattern(o, 1000, 1);
  o.layout = block_layout::global;
  o.global = 1;
  const block_pattern global = layout_block_pattern(o, 1000, 1);
  o.layout = block_layout::random;
  o.p = 0.8;
  const block_pattern random = layout_block_pattern(o, 1000, 3);
  ASSERT_EQ(random.num_heads(), 3);
  EXPECT_NE(random.heads[0], random.heads[1]);  // per head draws
  const block_pattern u = union_of({window, global, random});
  ASSERT_EQ(u.num_heads(), 3);
  for (std::int64_t h = 0; h < 3; ++h) {
    const csr_graph& g = u.heads[static_cast<std::size_t>(h)];
    for (std::int64_t r = 0; r < g.rows; ++r) {
      const auto row = std::span(g.col_idx).subspan(g.row_ptr[r], g.degree(r));
      const auto has = [&](std::int64_t c) {
        return std::ranges::binary_search(row, static_cast<std::int32_t>(c));
      };
      EXPECT_TRUE(has(r) && has(0)) << r;  // window's diagonal, global's first key block
      if (r + 1 < g.cols) {
        EXPECT_TRUE(has(r + 1)) << r;
      }
      const csr_graph& x = random.heads[static_cast<std::size_t>(h)];
      for (std::int64_t e = x.row_ptr[r]; e < x.row_ptr[r + 1]; ++e) EXPECT_TRUE(has(x.col_idx[e]));
    }
  }
  const block_sparse_mask m = u.to_mask(true);
  m.check();
  EXPECT_EQ(m.heads, 3);
  EXPECT_EQ(m.active_blocks(), u.heads[0].nnz() + u.heads[1].nnz() + u.heads[2].nnz());
  EXPECT_THROW(union_of({window, layout_block_pattern(o, 900, 1)}), invalid_input);
}

// Planted communities: 8 cliques of 64 nodes under shuffled ids, and 40 edges between them.
TEST(BlockPattern, CommunityOrderGathersPlantedCommunities) {
  constexpr std::int64_t groups = 8, size = 64, n = groups * size;
  std::vector<std::int64_t> id(static_cast<std::size_t>(n));
  std::iota(id.begin(), id.end(), 0);
  std::shuffle(id.begin(), id.end(), std::mt19937_64(7));
  coo_graph c;
  c.rows = c.cols = n;
  for (std::int64_t g = 0; g < groups; ++g)
    for (std::int64_t a = 0; a < size; ++a)
      for (std::int64_t b = 0; b < size; ++b)
        if (a != b) {
          c.src.push_back(id[static_cast<std::size_t>(g * size + a)]);
          c.dst.push_back(id[static_cast<std::size_t>(g * size + b)]);
        }
  std::mt19937_64 r(9);
  for (int e = 0; e < 40; ++e) {
    c.src.push_back(static_cast<std::int64_t>(r() % n));
    c.dst.push_back(static_cast<std::int64_t>(r() % n));
  }
  const csr_graph g = to_csr(c);
  const block_pattern p = community_block_pattern(g, size, 2);
  ASSERT_EQ(p.num_heads(), 2);
  EXPECT_EQ(p.heads[0], p.heads[1]);
  // Each clique sits in one contiguous range of positions.
  std::vector<std::int64_t> where(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) where[static_cast<std::size_t>(p.order[i])] = i;
  for (std::int64_t k = 0; k < groups; ++k) {
    std::int64_t lo = n, hi = -1;
    for (std::int64_t a = 0; a < size; ++a) {
      const std::int64_t x =
          where[static_cast<std::size_t>(id[static_cast<std::size_t>(k * size + a)])];
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    EXPECT_EQ(hi - lo, size - 1) << "clique " << k;
  }
  // The diagonal blocks and at most one block pair an inter-clique edge, against nearly every
  // block in the shuffled order.
  EXPECT_LE(p.heads[0].nnz(), groups + 2 * 40);
  EXPECT_GT(blocks_of(g, size).blocks.nnz(), 60);
  EXPECT_NE(p.made_by.find("community"), std::string::npos);
}

TEST(BlockPattern, FileRoundTripIsBitwiseEqual) {
  test::temp_dir dir;
  block_layout_options o;
  o.layout = block_layout::bigbird;
  o.block = 32;
  o.heads = 4;
  block_pattern p = layout_block_pattern(o, 1000, 4);
  p.order.resize(1000);
  std::iota(p.order.begin(), p.order.end(), 0);
  std::shuffle(p.order.begin(), p.order.end(), std::mt19937_64(3));
  save_block_pattern(p, dir / "a.tsbp");
  const block_pattern q = load_block_pattern(dir / "a.tsbp");
  EXPECT_EQ(q.block, p.block);
  EXPECT_EQ(q.rows, p.rows);
  EXPECT_EQ(q.cols, p.cols);
  EXPECT_EQ(q.heads, p.heads);
  EXPECT_EQ(q.order, p.order);
  EXPECT_EQ(q.made_by, p.made_by);
  save_block_pattern(q, dir / "b.tsbp");
  EXPECT_EQ(file_bytes(dir / "a.tsbp"), file_bytes(dir / "b.tsbp"));
}

// A damaged file's error names the file and the problem.
void expect_load_error(const std::filesystem::path& path, const std::string& problem) {
  try {
    load_block_pattern(path);
    ADD_FAILURE() << "no error for " << problem;
  } catch (const invalid_input& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path.string()), std::string::npos) << what;
    EXPECT_NE(what.find(problem), std::string::npos) << what;
  }
}

TEST(BlockPattern, DamagedFilesNameTheFileAndTheProblem) {
  test::temp_dir dir;
  save_block_pattern(small_pattern(), dir / "good.tsbp");
  const std::vector<char> good = file_bytes(dir / "good.tsbp");
  expect_load_error(dir / "missing.tsbp", "cannot open");
  std::vector<char> bytes = good;
  bytes.resize(bytes.size() - 20);
  write_bytes(dir / "cut.tsbp", bytes);
  expect_load_error(dir / "cut.tsbp", "truncated");
  bytes = good;
  bytes[bytes.size() - 12] ^= 1;  // a key block
  write_bytes(dir / "flipped.tsbp", bytes);
  expect_load_error(dir / "flipped.tsbp", "checksum");
  bytes = good;
  bytes[8] = 2;  // version 2
  write_bytes(dir / "v2.tsbp", bytes);
  expect_load_error(dir / "v2.tsbp", "version 2");
  write_bytes(dir / "text.tsbp", {'h', 'e', 'l', 'l', 'o'});
  expect_load_error(dir / "text.tsbp", "not a trisparse pattern file");
  std::filesystem::create_directory(dir / "folder.tsbp");
  expect_load_error(dir / "folder.tsbp", "is a directory");
}

// Pooled block mass by its definition, one head of 3 query and 2 key blocks of G = 2 (the last
// key block partial), causal aligned at the bottom right: the first block row sees no key.
TEST(ImportanceFold, PooledBlockMassByItsDefinition) {
  const std::vector<float> q = {1, 0, 3, 2, -1, 1, 0, 0, 2, 2, 1, -3};  // 6 rows, D = 2
  const std::vector<float> k = {1, 1, 0, 2, -2, 1};                     // 3 rows
  const auto qv = tensor_view::contiguous(const_cast<float*>(q.data()), dtype::f32, 6, 1, 2);
  const auto kv = tensor_view::contiguous(const_cast<float*>(k.data()), dtype::f32, 3, 1, 2);
  EXPECT_EQ(pooled_block_mass_workspace_bytes(1, 6, 3, 2, 2), 5 * 2 * sizeof(double));
  for (const bool causal : {false, true}) {
    std::vector<double> out(6, -1.0);
    pooled_block_mass(qv, kv, 2, causal, 0.5, out.data(), nullptr, 0);
    const double km[2][2] = {{0.5, 1.5}, {-2, 1}};  // key block means; keys 2 and 1
    for (int r = 0; r < 3; ++r) {
      const double qm[2] = {(q[4 * r] + q[4 * r + 2]) / 2, (q[4 * r + 1] + q[4 * r + 3]) / 2};
      const std::int64_t last = 2 * r + 1 - 3;  // the row's last query sees keys up to here
      double s[2], total = 0;
      for (int c = 0; c < 2; ++c) {
        const bool seen = !causal || 2 * c <= last;
        s[c] = seen ? std::exp(0.5 * (qm[0] * km[c][0] + qm[1] * km[c][1])) * (c == 0 ? 2 : 1) : 0;
        total += s[c];
      }
      for (int c = 0; c < 2; ++c)
        EXPECT_NEAR(out[2 * r + c], total > 0 ? s[c] / total : 0.0, 1e-14) << r << " " << c;
    }
  }
  std::vector<double> out(6);
  EXPECT_THROW(pooled_block_mass(qv, kv, 0, false, 0.5, out.data(), nullptr, 0), invalid_input);
  // The offline learner too refuses a block of 0 (it divided by it before).
  EXPECT_THROW(learn_block_pattern(qv, kv, 0, prune_options{}), invalid_input);
  const auto wide = tensor_view::contiguous(const_cast<float*>(k.data()), dtype::f32, 1, 1, 3);
  EXPECT_THROW(pooled_block_mass(qv, wide, 2, false, 0.5, out.data(), nullptr, 0), invalid_input);
}

// The fold: a kept block takes its batch-mean mass times the row's pooled total over the kept
// blocks, a dropped block its pooled estimate; a seen row blends, an unseen row is replaced.
TEST(ImportanceFold, FoldsMeasuredMassIntoTheAverage) {
  std::vector<double> state = {1, 1, 1, 1};  // 1 head, 2 rows, 2 key blocks
  const std::vector<float> mass = {0.25F, 0, 0.5F, 0.5F, 0.75F, 0, 0.5F, 0.5F};  // [2][1][2][2]
  const bool keep[4] = {true, false, true, true};
  const std::vector<double> pooled = {0.6, 0.4, 0.3, 0.7};
  const bool seen[2] = {true, false};
  importance_fold_args a;
  a.state = state.data();
  a.mass = mass.data();
  a.mass_strides[0] = 4;
  a.mass_strides[1] = 4;
  a.mass_strides[2] = 2;
  a.batch = 2;
  a.keep = keep;
  a.pooled = pooled.data();
  a.seen = seen;
  a.heads = 1;
  a.qb = a.kb = 2;
  a.decay = 0.5;
  fold_block_importance(a);
  EXPECT_DOUBLE_EQ(state[0], 0.5 + 0.5 * (0.5 * 0.6));  // kept: mean mass 0.5, kept total 0.6
  EXPECT_DOUBLE_EQ(state[1], 0.5 + 0.5 * 0.4);          // dropped: pooled
  EXPECT_DOUBLE_EQ(state[2], 0.5 * 1.0);                // unseen row: mean mass 0.5 x total 1
  EXPECT_DOUBLE_EQ(state[3], 0.5 * 1.0);
  a.decay = 1.0;
  EXPECT_THROW(fold_block_importance(a), invalid_input);
  a.decay = 0.5;
  a.batch = 0;
  EXPECT_THROW(fold_block_importance(a), invalid_input);
  // Not due: the state is left as it was.
  a.batch = 2;
  const bool not_due = false;
  a.due = &not_due;
  const std::vector<double> before = state;
  fold_block_importance(a);
  EXPECT_EQ(state, before);
}

// The schedule: warm-up 2, re-pruned every 3, tracked every 2, frozen after 9; the count moves on.
TEST(ImportanceFold, ScheduleCountsTheSteps) {
  std::int64_t steps = 2;
  bool flags[3] = {};
  learner_schedule_args a{&steps, flags, 2, 3, 2, 9};
  std::string got;
  for (int i = 0; i < 9; ++i) {
    advance_learner_schedule(a);
    for (const bool f : flags) got += f ? '1' : '0';
    got += ' ';
  }
  // s = 2 .. 10: prune at s = 3, 6, 9, fold at odd s < 9, track at even s < 8.
  EXPECT_EQ(got, "001 110 001 010 101 010 000 100 000 ");
  EXPECT_EQ(steps, 11);
  a.every = 0;
  EXPECT_THROW(advance_learner_schedule(a), invalid_input);
}

// The prune: forced blocks rank first, NaN above every number, ties (and -0 against 0) to the
// lower index; a row's or a head's budget; nothing written where not due.
TEST(ImportanceFold, PrunesToTheBudgetInStableOrder) {
  const double nan = std::nan("");
  const std::vector<double> imp = {0.1, 0.5, 0.5, -0.0,  // 1 head, 2 rows of 4 key blocks
                                   nan, 0.2, 0.0, -0.0};
  const bool forced[8] = {false, false, false, true, false, false, false, false};
  bool keep[8] = {};
  block_prune_args a;
  a.importance = imp.data();
  a.forced = forced;
  a.keep = keep;
  a.heads = 1;
  a.qb = 2;
  a.kb = 4;
  a.budget = 2;
  prune_block_importance(a);
  const bool rows[8] = {false, true, false, true, true, true, false, false};
  EXPECT_TRUE(std::equal(keep, keep + 8, rows));
  a.scope = prune_scope::global;
  a.budget = 3;
  prune_block_importance(a);
  const bool head[8] = {false, true, false, true, true, false, false, false};
  EXPECT_TRUE(std::equal(keep, keep + 8, head));
  a.forced = nullptr;
  a.budget = 6;  // NaN, 0.5, 0.5, 0.2, 0.1, then the first of the zeros (-0 at 3)
  prune_block_importance(a);
  const bool six[8] = {true, true, true, true, true, true, false, false};
  EXPECT_TRUE(std::equal(keep, keep + 8, six));
  const bool not_due = false;
  a.due = &not_due;
  a.budget = 1;
  prune_block_importance(a);
  EXPECT_TRUE(std::equal(keep, keep + 8, six));
  a.budget = 0;
  EXPECT_THROW(prune_block_importance(a), invalid_input);
  // A workspace only for a global prune of heads of more than 16,384 blocks (on CUDA).
  EXPECT_EQ(prune_block_importance_workspace_bytes(8, 128, 128, prune_scope::global), 0u);
  EXPECT_EQ(prune_block_importance_workspace_bytes(8, 512, 512, prune_scope::row), 0u);
  EXPECT_GT(prune_block_importance_workspace_bytes(8, 512, 512, prune_scope::global),
            prune_block_importance_workspace_bytes(8, 256, 256, prune_scope::global));
  EXPECT_THROW(prune_block_importance_workspace_bytes(-1, 1, 1, prune_scope::row), invalid_input);
}

}  // namespace
}  // namespace trisparse
