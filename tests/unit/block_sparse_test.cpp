// Block-sparse attention masks: each layout's defining property, the checks, causal expansion,
// and the float64 reference over ragged batches against a direct dense computation.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <set>

#include "support.hpp"
#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/ops/block_sparse.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse {
namespace {

bool has(const block_mask& m, std::int64_t i, std::int64_t j) {
  for (std::int64_t e = m.blocks.row_ptr[i]; e < m.blocks.row_ptr[i + 1]; ++e)
    if (m.blocks.col_idx[e] == j) return true;
  return false;
}

std::int64_t blocks_of(std::int64_t n, std::int64_t g) { return (n + g - 1) / g; }

TEST(BlockSparseMask, DeterministicLayoutsKeepExactlyTheirBlocks) {
  const std::vector<std::int64_t> lens{1000, 64, 1};
  for (const bool causal : {false, true}) {
    for (const block_layout l :
         {block_layout::dense, block_layout::window, block_layout::strided, block_layout::global}) {
      const block_sparse_mask mask = make_block_sparse_mask(
          {.layout = l, .block = 32, .window = 2, .stride = 5, .global = 3, .causal = causal},
          lens);
      mask.check();
      ASSERT_EQ(mask.batch(), 3);
      for (std::int64_t b = 0; b < mask.batch(); ++b) {
        const block_mask& m = mask.at(b, 0);
        const std::int64_t nb = blocks_of(lens[b], 32);
        ASSERT_EQ(m.blocks.rows, nb);
        for (std::int64_t i = 0; i < nb; ++i) {
          for (std::int64_t j = 0; j < nb; ++j) {
            bool want = l == block_layout::dense ||
                        (l == block_layout::window && std::abs(i - j) <= 2) ||
                        (l == block_layout::strided && (i - j) % 5 == 0) ||
                        (l == block_layout::global && (i < 3 || j < 3 || i == j));
            want = want && (!causal || j <= i);
            EXPECT_EQ(has(m, i, j), want) << "layout " << static_cast<int>(l) << " block " << i
                                          << ", " << j << " causal " << causal;
          }
        }
      }
    }
  }
}

TEST(BlockSparseMask, RandomKeepsTheDiagonalAndAboutOneMinusP) {
  for (const double p : {0.5, 0.9, 0.99}) {
    const block_sparse_mask mask =
        make_block_sparse_mask({.layout = block_layout::random, .block = 16, .p = p, .heads = 4},
                               std::vector<std::int64_t>{16 * 300});
    const std::int64_t nb = 300;
    for (std::int64_t h = 0; h < 4; ++h) {
      const block_mask& m = mask.at(0, h);
      for (std::int64_t i = 0; i < nb; ++i) ASSERT_TRUE(has(m, i, i));
      // Off-diagonal blocks kept: binomial(nb^2 - nb, 1 - p); 6 standard deviations.
      const double n = static_cast<double>(nb * nb - nb),
                   kept = static_cast<double>(m.blocks.nnz() - nb);
      EXPECT_NEAR(kept, n * (1 - p), 6 * std::sqrt(n * p * (1 - p)) + 1) << "p " << p;
    }
    // Per-head masks are drawn apart.
    EXPECT_NE(mask.at(0, 0).blocks.col_idx, mask.at(0, 1).blocks.col_idx);
  }
  // The same seed gives the same masks; causal drops only the blocks above the diagonal.
  const auto full = make_block_sparse_mask({.layout = block_layout::random, .p = 0.7, .seed = 3},
                                           std::vector<std::int64_t>{4000});
  const auto causal =
      make_block_sparse_mask({.layout = block_layout::random, .p = 0.7, .causal = true, .seed = 3},
                             std::vector<std::int64_t>{4000});
  for (std::int64_t i = 0; i < full.at(0, 0).blocks.rows; ++i) {
    for (std::int64_t j = 0; j < full.at(0, 0).blocks.cols; ++j)
      EXPECT_EQ(has(causal.at(0, 0), i, j), j <= i && has(full.at(0, 0), i, j));
  }
}

// The masks of a batch are drawn in parallel, each (sequence, head) from its own stream: the same
// masks with one thread as with all, and a sequence's masks do not depend on the others.
TEST(BlockSparseMask, DrawsDoNotDependOnThreadsOrOtherSequences) {
  for (const block_layout l : {block_layout::random, block_layout::bigbird}) {
    const block_layout_options o{.layout = l, .block = 8, .p = 0.8, .heads = 5, .seed = 11};
    const std::vector<std::int64_t> lens{700, 0, 1500, 64};
    const auto all = make_block_sparse_mask(o, lens);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto one = make_block_sparse_mask(o, lens);
    omp_set_num_threads(threads);
    ASSERT_EQ(all.masks.size(), one.masks.size());
    for (std::size_t x = 0; x < all.masks.size(); ++x) {
      EXPECT_EQ(all.masks[x].blocks.row_ptr, one.masks[x].blocks.row_ptr);
      EXPECT_EQ(all.masks[x].blocks.col_idx, one.masks[x].blocks.col_idx);
    }
    // The first sequence alone: the same masks as in the batch.
    const auto first = make_block_sparse_mask(o, std::vector<std::int64_t>{700});
    for (std::int64_t h = 0; h < o.heads; ++h)
      EXPECT_EQ(first.at(0, h).blocks.col_idx, all.at(0, h).blocks.col_idx);
  }
}

TEST(BlockSparseMask, BigBirdIsWindowGlobalAndRandomBlocksPerRow) {
  const block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::bigbird,
                                                         .block = 64,
                                                         .window = 1,
                                                         .global = 2,
                                                         .random = 3,
                                                         .heads = 2},
                                                        std::vector<std::int64_t>{64 * 40, 64 * 5});
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t h = 0; h < 2; ++h) {
      const block_mask& m = mask.at(b, h);
      const std::int64_t nb = m.blocks.rows;
      for (std::int64_t i = 0; i < nb; ++i) {
        std::int64_t structural = 0, extra = 0;
        for (std::int64_t j = 0; j < nb; ++j) {
          const bool s = std::abs(i - j) <= 1 || i < 2 || j < 2;
          structural += s;
          if (s) {
            EXPECT_TRUE(has(m, i, j));
          }
          extra += !s && has(m, i, j);
        }
        EXPECT_EQ(extra, std::min<std::int64_t>(3, nb - structural)) << "row " << i;
      }
    }
  }
}

TEST(BlockSparseMask, CheckNamesWhatIsBroken) {
  block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::window, .block = 16},
                                                  std::vector<std::int64_t>{100, 50});
  EXPECT_NO_THROW(mask.check());
  auto broken = mask;
  broken.cu_seqlens_q = {0, 100, 90};
  EXPECT_THROW(broken.check(), invalid_input);
  broken = mask;
  broken.masks.pop_back();
  EXPECT_THROW(broken.check(), invalid_input);
  broken = mask;
  broken.masks[1].block = 32;
  EXPECT_THROW(broken.check(), invalid_input);
  broken = mask;
  broken.cu_seqlens_k = {0, 100, 151};  // sequence 1's keys no longer match its mask
  EXPECT_THROW(broken.check(), invalid_input);
  EXPECT_THROW(make_block_sparse_mask({.p = 1.5}, std::vector<std::int64_t>{10}), invalid_input);
  EXPECT_THROW(make_block_sparse_mask({.stride = 0}, std::vector<std::int64_t>{10}), invalid_input);
}

// Dense softmax attention of one sequence and head, element mask allowed(i, j), in float64.
void dense_attention(const host_tensor& q, const host_tensor& k, const host_tensor& v,
                     std::int64_t q0, std::int64_t k0, std::int64_t lq, std::int64_t lk,
                     std::int64_t h, double scale, const auto& allowed, host_tensor& out) {
  const std::int64_t heads = q.heads(), d = q.dim();
  for (std::int64_t i = 0; i < lq; ++i) {
    std::vector<double> s(lk, -std::numeric_limits<double>::infinity());
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < lk; ++j) {
      if (!allowed(i, j)) continue;
      double dot = 0;
      for (std::int64_t c = 0; c < d; ++c)
        dot += q.get(((q0 + i) * heads + h) * d + c) * k.get(((k0 + j) * heads + h) * d + c);
      s[j] = scale * dot;
      m = std::max(m, s[j]);
    }
    for (std::int64_t c = 0; c < d; ++c) {
      double num = 0, den = 0;
      for (std::int64_t j = 0; j < lk; ++j) {
        if (s[j] == -std::numeric_limits<double>::infinity()) continue;
        const double w = std::exp(s[j] - m);
        den += w;
        num += w * v.get(((k0 + j) * heads + h) * d + c);
      }
      out.set(((q0 + i) * heads + h) * d + c, den > 0 ? num / den : 0.0);
    }
  }
}

TEST(BlockSparseReference, RaggedBatchPerHeadCausalEqualsDenseMaskedAttention) {
  const std::vector<std::int64_t> lens{70, 1, 33, 0, 100};
  const std::int64_t heads = 3, d = 8, g = 16;
  for (const bool causal : {false, true}) {
    const block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::random,
                                                           .block = g,
                                                           .p = 0.6,
                                                           .causal = causal,
                                                           .heads = heads,
                                                           .seed = 5},
                                                          lens);
    const std::int64_t n = mask.cu_seqlens_q.back();
    host_tensor q(dtype::f32, n, heads, d), k(dtype::f32, n, heads, d), v(dtype::f32, n, heads, d),
        out(dtype::f64, n, heads, d), want(dtype::f64, n, heads, d);
    q.fill_uniform(-1, 1, 1);
    k.fill_uniform(-1, 1, 2);
    v.fill_uniform(-1, 1, 3);
    out.fill(std::numeric_limits<double>::quiet_NaN());
    reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), out.view(), 0.5);
    for (std::int64_t b = 0; b < mask.batch(); ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const block_mask& m = mask.at(b, h);
        dense_attention(
            q, k, v, mask.cu_seqlens_q[b], mask.cu_seqlens_k[b], lens[b], lens[b], h, 0.5,
            [&](std::int64_t i, std::int64_t j) {
              return has(m, i / g, j / g) && (!causal || j <= i);
            },
            want);
      }
    }
    const auto e = test::compare(out, want);
    EXPECT_TRUE(e.finite);
    EXPECT_LE(e.relative(), 1e-12) << "causal " << causal;
  }
}

TEST(BlockSparseReference, EmptyBlockRowsAndRowsWithoutKeysGiveZeros) {
  // Sequence 0: block row 1 empty. Sequence 1: rectangular 40 queries x 8 keys, causal aligned at
  // the bottom right, so queries 0-31 have no key.
  block_sparse_mask mask;
  mask.block = 16;
  mask.causal = true;
  mask.cu_seqlens_q = {0, 48, 88};
  mask.cu_seqlens_k = {0, 48, 56};
  block_mask a{.rows = 48, .cols = 48, .block = 16, .blocks = {}};
  a.blocks.rows = a.blocks.cols = 3;
  a.blocks.row_ptr = {0, 1, 1, 3};
  a.blocks.col_idx = {0, 1, 2};
  block_mask c{.rows = 40, .cols = 8, .block = 16, .blocks = {}};
  c.blocks.rows = 3;
  c.blocks.cols = 1;
  c.blocks.row_ptr = {0, 1, 2, 3};
  c.blocks.col_idx = {0, 0, 0};
  mask.masks = {a, c};
  mask.check();
  EXPECT_EQ(mask.expand(1, 0).degree(31), 0);
  EXPECT_EQ(mask.expand(1, 0).degree(32), 1);
  EXPECT_EQ(mask.expand(1, 0).degree(39), 8);
  host_tensor q(dtype::f32, 88, 1, 4), k(dtype::f32, 56, 1, 4), v(dtype::f32, 56, 1, 4),
      out(dtype::f64, 88, 1, 4);
  q.fill_uniform(-1, 1, 1);
  k.fill_uniform(-1, 1, 2);
  v.fill_uniform(1, 2, 3);  // positive values: a non-empty row's output is positive
  out.fill(std::numeric_limits<double>::quiet_NaN());
  reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), out.view(), 1.0);
  for (std::int64_t i = 0; i < 88; ++i) {
    const bool empty = (i >= 16 && i < 32) || (i >= 48 && i < 48 + 32);
    for (std::int64_t c2 = 0; c2 < 4; ++c2) {
      if (empty)
        EXPECT_EQ(out.get(i * 4 + c2), 0.0) << "row " << i;
      else
        EXPECT_GT(out.get(i * 4 + c2), 0.0) << "row " << i;
    }
  }
  // A mask with 2 heads cannot serve 3 attention heads.
  block_sparse_mask two = make_block_sparse_mask({.heads = 2}, std::vector<std::int64_t>{8});
  host_tensor q3(dtype::f32, 8, 3, 4), o3(dtype::f64, 8, 3, 4);
  EXPECT_THROW(
      reference::block_sparse_attention(two, q3.view(), q3.view(), q3.view(), o3.view(), 1),
      invalid_input);
}

// The CPU engine (fp32) against the float64 reference: every granularity, causal or not, ragged
// lengths (0, 1, not multiples of G), per-head and shared masks.
TEST(BlockSparsePlan, CpuEngineMatchesTheReference) {
  const std::vector<std::int64_t> lens{130, 0, 1, 77, 256};
  std::uint64_t seed = 10;
  for (const std::int64_t g : {1, 2, 8, 16, 64, 128}) {
    for (const bool causal : {false, true}) {
      for (const std::int64_t mask_heads : {1, 2}) {
        ++seed;
        const block_layout l = g <= 8 ? block_layout::bigbird : block_layout::random;
        const auto plan =
            block_sparse_attention_plan::build(make_block_sparse_mask({.layout = l,
                                                                       .block = g,
                                                                       .p = 0.7,
                                                                       .window = 3,
                                                                       .global = 2,
                                                                       .random = 4,
                                                                       .causal = causal,
                                                                       .heads = mask_heads,
                                                                       .seed = seed},
                                                                      lens));
        EXPECT_EQ(plan.report().algo, algorithm::fused);
        std::int64_t pairs = 0;
        for (std::int64_t b = 0; b < plan.mask().batch(); ++b) {
          for (std::int64_t h = 0; h < mask_heads; ++h) pairs += plan.mask().expand(b, h).nnz();
        }
        EXPECT_EQ(plan.report().nnz, pairs);
        const std::int64_t n = plan.mask().cu_seqlens_q.back(), d = 24;
        // One dtype pair per mask, in turn (every pair and head dim: tests/generic).
        {
          const auto [in, out_type] =
              std::vector<std::pair<dtype, dtype>>{{dtype::f32, dtype::f32},
                                                   {dtype::f16, dtype::f16},
                                                   {dtype::bf16, dtype::f32}}[seed % 3];
          SCOPED_TRACE("G " + std::to_string(g) + " causal " + std::to_string(causal) +
                       " mask heads " + std::to_string(mask_heads) + " " +
                       std::string(to_string(in)) + "->" + std::string(to_string(out_type)));
          host_tensor q(in, n, 2, d), k(in, n, 2, d), v(in, n, 2, d), got(out_type, n, 2, d),
              want(dtype::f64, n, 2, d);
          q.fill_uniform(-2, 2, seed);
          k.fill_uniform(-2, 2, seed + 1);
          v.fill_uniform(-1, 1, seed + 2);
          got.fill(std::numeric_limits<double>::quiet_NaN());
          plan.run(q.view(), k.view(), v.view(), got.view());
          reference::block_sparse_attention(plan.mask(), q.view(), k.view(), v.view(), want.view(),
                                            effective_scale({}, d));
          const auto e = test::compare(got, want);
          EXPECT_TRUE(e.finite);
          EXPECT_LE(e.relative(), 4 * unit_roundoff(out_type) + 1e-5);
        }
      }
    }
  }
}

// Dynamic masks: every chosen block scores at least as high as every block left out, the count is
// min(top_k, allowed) (+ the diagonal), causal rows choose only blocks they may see, heads differ.
TEST(BlockSparseTopK, ChoosesTheHighestPooledScores) {
  const std::vector<std::int64_t> cu{0, 300, 301, 301, 557};
  const std::int64_t heads = 2, d = 16, g = 32;
  host_tensor q(dtype::f16, 557, heads, d), k(dtype::f16, 557, heads, d);
  q.fill_uniform(-1, 1, 7);
  k.fill_uniform(-1, 1, 8);
  for (const bool causal : {false, true}) {
    for (const bool diag : {false, true}) {
      const block_sparse_mask m =
          topk_block_mask(q.view(), k.view(), cu, cu,
                          {.block = g, .top_k = 3, .causal = causal, .keep_diagonal = diag});
      ASSERT_EQ(m.heads, heads);
      ASSERT_EQ(m.batch(), 4);
      for (std::int64_t b = 0; b < m.batch(); ++b) {
        const std::int64_t len = m.len_q(b), nb = (len + g - 1) / g;
        for (std::int64_t h = 0; h < heads; ++h) {
          // Pooled means in float64, as the definition says.
          const auto mean = [&](const host_tensor& t, std::int64_t blk, std::int64_t c) {
            double sum = 0;
            const std::int64_t r0 = blk * g, r1 = std::min(len, r0 + g);
            for (std::int64_t i = r0; i < r1; ++i) sum += t.get(((cu[b] + i) * heads + h) * d + c);
            return sum / static_cast<double>(r1 - r0);
          };
          const auto score = [&](std::int64_t r, std::int64_t c) {
            double s2 = 0;
            for (std::int64_t x = 0; x < d; ++x) s2 += mean(q, r, x) * mean(k, c, x);
            return s2;
          };
          const block_mask& bm = m.at(b, h);
          for (std::int64_t r = 0; r < nb; ++r) {
            const std::int64_t allowed = causal ? r + 1 : nb;
            std::vector<std::int64_t> chosen, left;
            for (std::int64_t c = 0; c < allowed; ++c) (has(bm, r, c) ? chosen : left).push_back(c);
            for (std::int64_t c = allowed; c < nb; ++c) EXPECT_FALSE(has(bm, r, c));
            const std::int64_t want = std::min<std::int64_t>(3, allowed);
            const bool diag_extra =
                diag && std::find(chosen.begin(), chosen.end(), r) != chosen.end();
            ASSERT_GE(static_cast<std::int64_t>(chosen.size()), want);
            ASSERT_LE(static_cast<std::int64_t>(chosen.size()), want + (diag_extra ? 1 : 0));
            if (diag) {
              EXPECT_TRUE(has(bm, r, r));
            }
            // The top_k best: all but possibly the diagonal beat everything left out.
            std::vector<double> kept;
            for (const std::int64_t c : chosen) kept.push_back(score(r, c));
            std::sort(kept.rbegin(), kept.rend());
            for (const std::int64_t c : left)
              EXPECT_LE(score(r, c), kept[static_cast<std::size_t>(want - 1)] + 1e-12);
          }
        }
      }
      EXPECT_NE(m.at(0, 0).blocks.col_idx, m.at(0, 1).blocks.col_idx);
    }
  }
  // The mask runs: the plan checks it, and the CPU engine agrees with the reference.
  const auto plan = block_sparse_attention_plan::build(
      topk_block_mask(q.view(), k.view(), cu, cu, {.block = g, .top_k = 2, .causal = true}));
  host_tensor got(dtype::f32, 557, heads, d), want(dtype::f64, 557, heads, d);
  plan.run(q.view(), k.view(), k.view(), got.view());
  reference::block_sparse_attention(plan.mask(), q.view(), k.view(), k.view(), want.view(),
                                    effective_scale({}, d));
  EXPECT_LE(test::compare(got, want).relative(), 1e-5);
  EXPECT_THROW(topk_block_mask(q.view(), k.view(), std::vector<std::int64_t>{0, 556}, cu, {}),
               invalid_input);
  EXPECT_THROW(topk_block_mask(q.view(), k.view(), cu, cu, {.top_k = -1}), invalid_input);
}

// A plan for a mask on the device names what is wrong before it needs a device: a layout with
// masks, broken offsets, a mask that does not cover the sequences, another algorithm.
TEST(BlockSparsePlan, MaskOnTheDeviceNamesBadArguments) {
  block_sparse_mask layout;
  layout.block = 64;
  layout.heads = 2;
  layout.cu_seqlens_q = {0, 100, 300};
  layout.cu_seqlens_k = {0, 200, 264};
  std::uint8_t byte = 1;
  // 2 x 4 blocks cover lengths 100/200 and 200/64 at G = 64 (queries up to 4 blocks, keys 4).
  const device_block_mask kept{&byte, 0, 0, 16, 4, 4, 4};
  const auto message = [&](block_sparse_mask l, device_block_mask k,
                           block_sparse_plan_options o = {}) -> std::string {
    try {
      (void)block_sparse_attention_plan::build(std::move(l), k, o);
    } catch (const invalid_input& e) {
      return e.what();
    } catch (const error&) {
      return "no device";
    }
    return "accepted";
  };
  block_sparse_mask with_masks =
      make_block_sparse_mask({.block = 64}, std::vector<std::int64_t>{64});
  EXPECT_NE(message(with_masks, kept).find("without masks"), std::string::npos);
  block_sparse_mask broken = layout;
  broken.cu_seqlens_q = {0, 300, 100};
  const std::string offsets = message(broken, kept);
  EXPECT_TRUE(offsets != "no device" && offsets != "accepted") << offsets;
  device_block_mask small = kept;
  small.rows = 3;
  EXPECT_NE(message(layout, small).find("do not cover"), std::string::npos);
  device_block_mask overlapping = kept;
  overlapping.row_stride = 2;
  EXPECT_NE(message(layout, overlapping).find("strides"), std::string::npos);
  EXPECT_NE(message(layout, kept, {.algo = algorithm::unfused}).find("algorithm::block"),
            std::string::npos);
  if (!cuda_available()) {
    EXPECT_EQ(message(layout, kept), "no device");
  }
}

TEST(BlockSparsePlan, RejectsWhatItCannotRun) {
  const auto mask =
      make_block_sparse_mask({.block = 16, .heads = 2}, std::vector<std::int64_t>{40, 24});
  const auto plan = block_sparse_attention_plan::build(mask);
  host_tensor q(dtype::f32, 64, 2, 8), o(dtype::f32, 64, 2, 8), short_q(dtype::f32, 63, 2, 8),
      three(dtype::f32, 64, 3, 8);
  EXPECT_NO_THROW(plan.run(q.view(), q.view(), q.view(), o.view()));
  EXPECT_THROW(plan.run(short_q.view(), q.view(), q.view(), o.view()), invalid_input);
  EXPECT_THROW(plan.run(three.view(), three.view(), three.view(), three.view()), invalid_input);
  EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), o.view(), {.algo = algorithm::block}),
               invalid_input);
  EXPECT_THROW(
      plan.run(q.view(), q.view(), q.view(), o.view(), {.algo = algorithm::blocked_reference}),
      invalid_input);
  EXPECT_THROW(
      block_sparse_attention_plan::build(mask, device_kind::cpu, {.algo = algorithm::unfused}),
      invalid_input);
  EXPECT_THROW(
      block_sparse_attention_plan::build(mask, device_kind::cpu, {.algo = algorithm::block}),
      invalid_input);
  EXPECT_THROW(block_sparse_attention_plan::build(mask, device_kind::cuda,
                                                  {.algo = algorithm::blocked_reference}),
               invalid_input);
  // Without a GPU: not_supported (no CUDA backend) or cuda_error (no device).
  if (!cuda_available()) {
    EXPECT_THROW(block_sparse_attention_plan::build(mask, device_kind::cuda), error);
    EXPECT_THROW(
        block_sparse_attention_plan::build(mask, device_kind::cuda, {.algo = algorithm::unfused}),
        error);
  }
  EXPECT_THROW((void)plan.run_timing_stages(q.view(), q.view(), q.view(), o.view()), invalid_input);
  auto broken = mask;
  broken.masks.pop_back();
  EXPECT_THROW(block_sparse_attention_plan::build(broken), invalid_input);
}

// A block bias: a zero bias changes nothing (up to rounding: the CPU runs a biased call on the
// element pattern's engine), and what cannot take one, or a bias of the wrong shape, is refused
// with a message naming it.
TEST(BlockSparsePlan, BlockBiasArguments) {
  const auto mask =
      make_block_sparse_mask({.block = 16, .heads = 2}, std::vector<std::int64_t>{40, 24});
  const auto plan = block_sparse_attention_plan::build(mask);
  // [batch * QB, H, KB]: QB = KB = 3 (the longest sequence, 40 rows of blocks of 16).
  host_tensor q(dtype::f32, 64, 2, 8), a(dtype::f32, 64, 2, 8), b(dtype::f32, 64, 2, 8),
      zero(dtype::f32, 6, 2, 3), shared(dtype::f32, 6, 1, 3), wrong(dtype::f32, 6, 2, 4),
      mass(dtype::f32, 6, 2, 3);
  q.fill_uniform(-1, 1, 3);
  zero.fill(0.0);
  shared.fill(0.0);
  plan.run(q.view(), q.view(), q.view(), a.view());
  plan.run(q.view(), q.view(), q.view(), b.view(), {.block_bias = zero.view()});
  EXPECT_LT(test::compare(b, a).relative(), 1e-6);
  plan.run(q.view(), q.view(), q.view(), b.view(), {.block_bias = shared.view()});
  EXPECT_LT(test::compare(b, a).relative(), 1e-6);
  const auto names = [](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << "taken: " << what;
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  names([&] { plan.run(q.view(), q.view(), q.view(), a.view(), {.block_bias = wrong.view()}); },
        "block_bias");
  names([&] { plan.run(q.view(), q.view(), q.view(), a.view(), {.dblock_bias = zero.view()}); },
        "dblock_bias");
  names(
      [&] {
        plan.backward(q.view(), q.view(), q.view(), {}, {}, q.view(), a.view(), b.view(), b.view(),
                      {.dblock_bias = zero.view()});
      },
      "dblock_bias");
  names(
      [&] {
        plan.backward(q.view(), q.view(), q.view(), {}, {}, q.view(), a.view(), b.view(), b.view(),
                      {.block_bias = shared.view(), .dblock_bias = shared.view()});
      },
      "dblock_bias");
  names(
      [&] {
        plan.backward(q.view(), q.view(), q.view(), {}, {}, q.view(), a.view(), b.view(), b.view(),
                      {.block_mass = mass.view(), .block_bias = zero.view()});
      },
      "block bias");
  names(
      [&] {
        plan.block_mass(q.view(), q.view(), {},
                        {.block_mass = mass.view(), .block_bias = zero.view()});
      },
      "block bias");
  const auto graph = attention_plan::build(mask.expand(0, 0));
  host_tensor x(dtype::f32, 40, 2, 8), y(dtype::f32, 40, 2, 8);
  x.fill_uniform(-1, 1, 4);
  names([&] { graph.run(x.view(), x.view(), x.view(), y.view(), {.block_bias = zero.view()}); },
        "block bias");
}

// The block importance tests' f32 inputs of `rows` rows, `heads` heads of 8: q and k uniform in
// [-span, span], v and dout in [-1, 1] (seeds seed .. seed + 3), and the gradients' outputs.
struct importance_inputs {
  host_tensor q, k, v, dout, dq, dk, dv;
  importance_inputs(std::int64_t rows, std::int64_t heads, double span, std::uint64_t seed)
      : q(dtype::f32, rows, heads, 8),
        k(dtype::f32, rows, heads, 8),
        v(dtype::f32, rows, heads, 8),
        dout(dtype::f32, rows, heads, 8),
        dq(dtype::f32, rows, heads, 8),
        dk(dtype::f32, rows, heads, 8),
        dv(dtype::f32, rows, heads, 8) {
    q.fill_uniform(-span, span, seed);
    k.fill_uniform(-span, span, seed + 1);
    v.fill_uniform(-1, 1, seed + 2);
    dout.fill_uniform(-1, 1, seed + 3);
  }
};

// Block importance on the CPU (attention_options::block_mass, block_grad): with every block kept a
// block row's masses sum to 1 and every |dS| sum is >= 0, in each dtype the outputs take; ragged
// sequences use rows b * QB + r; wrong shapes and dtypes are named.
TEST(BlockSparseImportance, FullMaskRowsSumToOneAndBadViewsAreNamed) {
  const std::vector<std::int64_t> lens{70, 33};
  const auto mask = make_block_sparse_mask({.layout = block_layout::dense, .block = 16}, lens);
  const auto plan = block_sparse_attention_plan::build(mask);
  const std::int64_t heads = 2, qb = 5, kb = 5;
  importance_inputs x(103, heads, 1.0, 1);
  host_tensor &q = x.q, &k = x.k, &v = x.v, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  for (const dtype t : {dtype::f32, dtype::f64}) {
    host_tensor mass(t, 2 * qb, heads, kb), grad(t, 2 * qb, heads, kb);
    plan.backward(q.view(), k.view(), v.view(), {}, {}, dout.view(), dq.view(), dk.view(),
                  dv.view(), {.block_mass = mass.view(), .block_grad = grad.view()});
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t blocks = (lens[static_cast<std::size_t>(b)] + 15) / 16;
      for (std::int64_t r = 0; r < blocks; ++r) {
        for (std::int64_t h = 0; h < heads; ++h) {
          double sum = 0.0;
          for (std::int64_t c = 0; c < blocks; ++c) {
            sum += mass.get(mass.view().offset(b * qb + r, h, c));
            EXPECT_GE(grad.get(grad.view().offset(b * qb + r, h, c)), 0.0);
          }
          EXPECT_NEAR(sum, 1.0, 1e-6) << "sequence " << b << " block row " << r;
        }
      }
    }
  }
  host_tensor short_rows(dtype::f32, qb, heads, kb), half(dtype::f16, 2 * qb, heads, kb);
  for (const tensor_view& bad : {short_rows.view(), half.view()}) {
    try {
      plan.backward(q.view(), k.view(), v.view(), {}, {}, dout.view(), dq.view(), dk.view(),
                    dv.view(), {.block_mass = bad});
      ADD_FAILURE() << "a bad block_mass was accepted";
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find("block_mass"), std::string::npos) << e.what();
    }
  }
}

// block_mass (the mass without a backward) on the CPU: the backward's masses to the bit, with no
// v, dout or lse (it recomputes the softmax); causal masks too; block_grad, a missing block_mass
// and bad views are refused naming them.
TEST(BlockSparseImportance, MassWithoutABackwardEqualsTheBackwards) {
  const std::vector<std::int64_t> lens{70, 33};
  const std::int64_t heads = 2, qb = 5, kb = 5;
  importance_inputs x(103, heads, 2.0, 5);
  host_tensor &q = x.q, &k = x.k, &v = x.v, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  for (const bool causal : {false, true}) {
    const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                              .block = 16,
                                              .p = 0.5,
                                              .causal = causal,
                                              .heads = heads,
                                              .seed = 3},
                                             lens);
    const auto plan = block_sparse_attention_plan::build(mask);
    host_tensor want(dtype::f64, 2 * qb, heads, kb), got(dtype::f64, 2 * qb, heads, kb);
    want.fill(-7.0);  // dropped blocks: not written by either
    got.fill(-7.0);
    plan.backward(q.view(), k.view(), v.view(), {}, {}, dout.view(), dq.view(), dk.view(),
                  dv.view(), {.block_mass = want.view()});
    plan.block_mass(q.view(), k.view(), {}, {.block_mass = got.view()});
    EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size_bytes()), 0) << "causal " << causal;
    EXPECT_EQ(plan.block_mass_workspace_bytes(heads), 0U);
  }
  const auto plan = block_sparse_attention_plan::build(
      make_block_sparse_mask({.layout = block_layout::dense, .block = 16}, lens));
  host_tensor mass(dtype::f32, 2 * qb, heads, kb), short_rows(dtype::f32, qb, heads, kb);
  const auto refused = [&](const attention_options& o, const char* name) {
    try {
      plan.block_mass(q.view(), k.view(), {}, o);
      ADD_FAILURE() << name << ": accepted";
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  refused({.block_mass = mass.view(), .block_grad = mass.view()}, "block_grad");
  refused({}, "block_mass");
  refused({.block_mass = short_rows.view()}, "block_mass");
}

}  // namespace
}  // namespace trisparse
