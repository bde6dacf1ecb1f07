// The CUDA block-sparse attention (the tensor-core block kernel for G a multiple of 16, the fused
// BSB kernel for finer blocks) against the float64 reference (label gpu; skipped without a
// device).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include "device_tensor.hpp"
#include "topk_rows.hpp"

namespace trisparse {
namespace {

struct config {
  dtype in, out;
  std::int64_t dim;
};

// The pairs and head dims the per-kernel tests take in turn (the full cross product on small
// masks: tests/generic).
constexpr config kConfigs[] = {{dtype::f16, dtype::f32, 64},  {dtype::bf16, dtype::bf16, 128},
                               {dtype::f16, dtype::f16, 128}, {dtype::bf16, dtype::f32, 64},
                               {dtype::f16, dtype::bf16, 64}, {dtype::bf16, dtype::f16, 128}};

// Runs the plan twice on poisoned outputs and checks: every output finite, both runs bitwise
// equal, every row within tolerance of the float64 reference, rows with no key exactly zero.
void check(const block_sparse_attention_plan& plan, const config& c, std::int64_t heads,
           std::uint64_t seed, double scale = 0.125, double lo = -1.0, double hi = 1.0) {
  const block_sparse_mask& m = plan.mask();
  SCOPED_TRACE(std::string(to_string(c.in)) + "->" + std::string(to_string(c.out)) + " d" +
               std::to_string(c.dim) + " G" + std::to_string(m.block) + " causal " +
               std::to_string(m.causal) + " heads " + std::to_string(heads) + "/" +
               std::to_string(m.heads) + " " + plan.report().format);
  const std::int64_t nq = m.cu_seqlens_q.back(), nk = m.cu_seqlens_k.back();
  host_tensor hq(c.in, nq, heads, c.dim), hk(c.in, nk, heads, c.dim), hv(c.in, nk, heads, c.dim);
  hq.fill_uniform(lo, hi, seed);
  hk.fill_uniform(lo, hi, seed + 1);
  hv.fill_uniform(lo, hi, seed + 2);
  test::device_tensor q(hq), k(hk), v(hv), out(host_tensor(c.out, nq, heads, c.dim));
  host_tensor first;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out, [&] { plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale}); }, first));
  host_tensor want(dtype::f64, nq, heads, c.dim);
  reference::block_sparse_attention(m, hq.view(), hk.view(), hv.view(), want.view(), scale);
  const auto e = test::compare(first, want);
  ASSERT_TRUE(e.finite) << "unwritten or non-finite outputs";
  EXPECT_LE(e.relative(), test::gpu_tolerance(c.in, c.out, 4)) << "max abs " << e.max_abs;
  std::int64_t wrong_zeros = 0;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const csr_graph pattern = m.expand(b, h);
      for (std::int64_t i = 0; i < m.len_q(b); ++i) {
        if (pattern.degree(i) != 0) continue;
        for (std::int64_t x = 0; x < c.dim; ++x)
          wrong_zeros += first.get(first.view().offset(m.cu_seqlens_q[b] + i, h, x)) != 0.0;
      }
    }
  }
  EXPECT_EQ(wrong_zeros, 0) << "rows with no key must give exact zeros";
}

block_sparse_attention_plan cuda_plan(const block_sparse_mask& m,
                                      block_kernel kernel = block_kernel::automatic) {
  return block_sparse_attention_plan::build(m, device_kind::cuda, {.kernel = kernel});
}

// Plans for every kernel that runs the mask here: mma.sync always; wgmma too where the block is a
// multiple of 64 and the device is sm_90, and the two-warpgroup wgmma kernel where it is a
// multiple of 128 (elsewhere their plans must refuse with not_supported).
std::vector<block_sparse_attention_plan> plans_for(const block_sparse_mask& m) {
  std::vector<block_sparse_attention_plan> plans{cuda_plan(m, block_kernel::mma_sync)};
  EXPECT_NE(plans[0].report().format.find("mma.sync"), std::string::npos);
  struct wgmma_kernel {
    block_kernel kernel;
    std::int64_t block;
    const char* name;
  };
  for (const wgmma_kernel k : {wgmma_kernel{block_kernel::wgmma, 64, "wgmma"},
                               wgmma_kernel{block_kernel::wgmma_pingpong, 128, "two warpgroups"}}) {
    try {
      plans.push_back(cuda_plan(m, k.kernel));
      EXPECT_EQ(m.block % k.block, 0);
      EXPECT_NE(plans.back().report().format.find(k.name), std::string::npos);
    } catch (const not_supported& e) {
      if (m.block % k.block == 0) std::printf("[ info ] no %s kernel here: %s\n", k.name, e.what());
    }
  }
  return plans;
}

// A random mask at block g (2 mask heads, p = 0.3) whose odd block rows keep no block.
block_sparse_mask odd_block_rows_emptied(std::int64_t g, const std::vector<std::int64_t>& lens) {
  auto mask = make_block_sparse_mask(
      {.layout = block_layout::random, .block = g, .p = 0.3, .heads = 2, .seed = 4}, lens);
  for (block_mask& m : mask.masks) {
    csr_graph kept;
    kept.rows = m.blocks.rows;
    kept.cols = m.blocks.cols;
    for (std::int64_t r = 0; r < m.blocks.rows; ++r) {
      if (r % 2 == 0) {
        for (std::int64_t e = m.blocks.row_ptr[r]; e < m.blocks.row_ptr[r + 1]; ++e)
          kept.col_idx.push_back(m.blocks.col_idx[e]);
      }
      kept.row_ptr.push_back(kept.nnz());
    }
    m.blocks = kept;
  }
  return mask;
}

// Every block size of the tensor-core kernel, causal and not, on a ragged batch (lengths 0, 1,
// not multiples of G) with per-head random masks; each plan at one dtype pair and head dim in turn
// (every pair x head dim: tests/generic).
TEST(GpuBlockSparse, EveryBlockSizeAgainstTheReference) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64};
  std::uint64_t seed = 1;
  for (const std::int64_t g : {16, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                .block = g,
                                                .p = 0.5,
                                                .causal = causal,
                                                .heads = 2,
                                                .seed = seed++},
                                               lens);
      for (const auto& plan : plans_for(mask)) {
        ASSERT_EQ(plan.report().algo, algorithm::block);
        const auto& c = kConfigs[seed % std::size(kConfigs)];
        check(plan, c, 2, seed++);
      }
    }
  }
}

// The wgmma kernels (one warpgroup; two at G = 128) on K and V views that are not
// [rows, heads, D] packed: head-major storage and rows padded by a head's width. Full key tiles
// arrive by TMA, partial ones by cp.async; the 1500-key sequence reuses every stage.
TEST(GpuBlockSparse, WgmmaKernelOnStridedKeyValueViews) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{200, 64, 130, 0, 384, 1500};
  const std::int64_t heads = 2, nk = std::accumulate(lens.begin(), lens.end(), std::int64_t{0});
  for (const std::int64_t g : {64, 128}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask(
          {.layout = block_layout::random, .block = g, .p = 0.4, .causal = causal, .seed = 9},
          lens);
      const std::vector<block_sparse_attention_plan> plans = plans_for(mask);
      if (plans.size() < (g == 128 ? 3u : 2u)) {
        std::printf("[ info ] no wgmma kernel here\n");
        return;
      }
      const block_sparse_attention_plan& plan = plans.back();
      for (const std::int64_t d : {64, 128}) {
        // storage (rows, heads, dim of the host_tensor) and the view's heads and strides over it.
        struct layout {
          const char* name;
          std::int64_t rows, heads, row_stride, head_stride;
        };
        for (const layout& l : {layout{"head-major", heads, nk, d, nk * d},
                                layout{"padded rows", nk, heads + 1, (heads + 1) * d, d}}) {
          SCOPED_TRACE(std::string(l.name) + " d" + std::to_string(d) + " G" + std::to_string(g) +
                       " causal " + std::to_string(causal) + " " + plan.report().format);
          const auto strided = [&](tensor_view v) {
            v.rows = nk;
            v.heads = heads;
            v.row_stride = l.row_stride;
            v.head_stride = l.head_stride;
            return v;
          };
          host_tensor hq(dtype::f16, nk, heads, d), hk(dtype::f16, l.rows, l.heads, d),
              hv(dtype::f16, l.rows, l.heads, d);
          hq.fill_uniform(-1, 1, 11 + d);
          hk.fill_uniform(-1, 1, 12 + d);
          hv.fill_uniform(-1, 1, 13 + d);
          test::device_tensor q(hq), k(hk), v(hv), out(host_tensor(dtype::f32, nk, heads, d));
          host_tensor first;
          ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
              out,
              [&] {
                plan.run(q.view(), strided(k.view()), strided(v.view()), out.view(),
                         {.scale = 0.125});
              },
              first));
          host_tensor want(dtype::f64, nk, heads, d);
          reference::block_sparse_attention(mask, hq.view(), strided(hk.view()), strided(hv.view()),
                                            want.view(), 0.125);
          const auto e = test::compare(first, want);
          ASSERT_TRUE(e.finite) << "unwritten or non-finite outputs";
          EXPECT_LE(e.relative(), test::gpu_tolerance(dtype::f16, dtype::f32, 4));
        }
      }
    }
  }
}

// The two-warpgroup kernel over many short sequences (more blocks than SMs): 200 sequences of 0
// to 400 rows (multiples of 128 among them), G = 128, a mask per head, causal and not.
TEST(GpuBlockSparse, ManyWorkItemsPerBlock) {
  SKIP_WITHOUT_GPU();
  std::vector<std::int64_t> lens;
  for (std::int64_t b = 0; b < 200; ++b)
    lens.push_back(b % 7 == 0 ? 128 * (b % 4) : (b * 37) % 401);
  for (const bool causal : {false, true}) {
    const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                              .block = 128,
                                              .p = 0.3,
                                              .causal = causal,
                                              .heads = 2,
                                              .seed = 21},
                                             lens);
    for (const auto& plan : plans_for(mask)) {
      if (plan.report().format.find("two warpgroups") == std::string::npos) continue;
      for (const std::int64_t d : {64, 128}) check(plan, {dtype::f16, dtype::f32, d}, 2, 60 + d);
      check(plan, {dtype::bf16, dtype::bf16, 64}, 2, 70);
    }
  }
}

// A shared mask for 3 heads; the report's layouts; a dense mask; one block per row; empty block
// rows; large, all-positive, negatively scaled and zero-scaled scores.
TEST(GpuBlockSparse, LayoutsAndEdgeCases) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{200, 129, 64};
  const config c{dtype::f16, dtype::f32, 64};
  for (const block_layout l : {block_layout::dense, block_layout::window, block_layout::strided,
                               block_layout::global, block_layout::bigbird}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask({.layout = l,
                                                .block = 32,
                                                .window = l == block_layout::window ? 0 : 1,
                                                .stride = 3,
                                                .causal = causal,
                                                .seed = 9},
                                               lens);
      check(cuda_plan(mask), c, 3, 40 + static_cast<std::uint64_t>(l));
    }
  }
  // Every other block row emptied: its rows give zeros.
  for (const auto& plan : plans_for(odd_block_rows_emptied(64, lens)))
    check(plan, {dtype::bf16, dtype::bf16, 128}, 2, 77);
  // Scores near 1e4 (scale 100 on inputs of magnitude <= 1, d = 64) and positive-only inputs; at
  // G = 128 through the two-warpgroup kernel too.
  for (const std::int64_t g : {16, 64, 128}) {
    const auto dense = make_block_sparse_mask({.layout = block_layout::dense, .block = g}, lens);
    for (const auto& plan : plans_for(dense)) {
      check(plan, c, 1, 5, 100.0);
      check(plan, c, 1, 6, 1.0, 0.25, 1.0);
      // Negative scales (the kernels negate Q and use |scale|) and a zero scale (uniform weights).
      check(plan, c, 1, 7, -0.4);
      check(plan, c, 1, 8, -100.0);
      check(plan, c, 1, 9, 0.0);
    }
  }
}

// Rectangular causal sequences (more queries than keys: the first queries see no key) from the
// dynamic top-k builder.
TEST(GpuBlockSparse, RectangularCausalTopKMasks) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> cu_q{0, 300, 301, 700}, cu_k{0, 100, 400, 700};
  for (const std::int64_t g : {16, 64, 128}) {
    host_tensor q(dtype::f16, 700, 2, 64), k(dtype::f16, 700, 2, 64);
    q.fill_uniform(-1, 1, 1);
    k.fill_uniform(-1, 1, 2);
    const auto mask =
        topk_block_mask(q.view(), k.view(), cu_q, cu_k, {.block = g, .top_k = 2, .causal = true});
    for (const auto& plan : plans_for(mask)) check(plan, {dtype::f16, dtype::f16, 64}, 2, 11);
  }
}

// Blocks finer than 16 go through the fused BSB kernel as element patterns.
TEST(GpuBlockSparse, FineBlocksRunAsElementPatterns) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{90, 1, 130};
  for (const std::int64_t g : {1, 2, 8, 24}) {
    for (const std::int64_t heads : {1, 2}) {
      const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                .block = g,
                                                .p = 0.7,
                                                .causal = heads == 2,
                                                .heads = heads,
                                                .seed = 3},
                                               lens);
      const auto plan = cuda_plan(mask);
      ASSERT_EQ(plan.report().algo, algorithm::fused);
      check(plan, {dtype::bf16, dtype::f32, 64}, 2, 21);
    }
  }
}

// The device's top-k selection (expect_topk_rows), on ragged sequences, one of 2500 rows (157
// key blocks at G = 16: three staged chunks); and attention under it equals, bitwise, a plan
// built from the downloaded mask, itself checked against the float64 reference.
TEST(GpuBlockSparse, TopKMasksSelectedOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> cu_q{0, 300, 301, 818, 882, 882, 3382},
      cu_k{0, 300, 400, 917, 981, 981, 3481};
  const std::int64_t heads = 2, d = 64;
  std::uint64_t seed = 100;
  for (const std::int64_t g : {16, 64, 128}) {
    for (const bool causal : {false, true}) {
      for (const std::int64_t top_k : {0, 3, 26}) {
        const topk_mask_options o{
            .block = g, .top_k = top_k, .causal = causal, .keep_diagonal = top_k != 3};
        SCOPED_TRACE("G" + std::to_string(g) + " causal " + std::to_string(causal) + " top " +
                     std::to_string(top_k));
        host_tensor hq(dtype::f16, cu_q.back(), heads, d), hk(dtype::f16, cu_k.back(), heads, d);
        hq.fill_uniform(-1, 1, seed++);
        hk.fill_uniform(-1, 1, seed++);
        test::device_tensor q(hq), k(hk);
        auto plan = topk_block_sparse_plan::build(cu_q, cu_k, heads, d, o);
        EXPECT_THROW(plan.mask(), invalid_input);  // nothing selected yet
        plan.select(q.view(), k.view());
        const block_sparse_mask got = plan.mask();
        ASSERT_NO_FATAL_FAILURE(test::expect_topk_rows(got, hq, hk, o));
        // Attention under the selected mask: as a plan of the downloaded mask computes it (to
        // rounding: the plans may launch a tile in different waves, whose key orders differ; both
        // are within the tolerance of the reference, so within twice it of each other).
        if (got.active_blocks() == 0) continue;
        const auto from_mask = cuda_plan(got);
        check(from_mask, {dtype::f16, dtype::f32, d}, heads, seed);
        host_tensor hv(dtype::f16, cu_k.back(), heads, d);
        hv.fill_uniform(-1, 1, seed++);
        test::device_tensor v(hv), out(host_tensor(dtype::f32, cu_q.back(), heads, d));
        host_tensor a, b;
        ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
            out, [&] { plan.run(q.view(), k.view(), v.view(), out.view()); }, a));
        ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
            out, [&] { from_mask.run(q.view(), k.view(), v.view(), out.view()); }, b));
        const auto e = test::compare(a, b);
        EXPECT_TRUE(e.finite);
        EXPECT_LE(e.relative(), 2 * test::gpu_tolerance(dtype::f16, dtype::f32, 4));
      }
    }
  }
}

// Launches of several waves of blocks (the odd waves walk their keys in descending order,
// params::down_wave): every kernel on random masks, causal and not (the descending walk skips
// the key tiles past a tile's causal limit), and a top-k plan (it skips a row's unused slots).
TEST(GpuBlockSparse, BlocksOfLaterWavesWalkKeysDownwards) {
  SKIP_WITHOUT_GPU();
  // 4 heads of 200 query tiles of 64 rows (100 of 128 in the two-warpgroup kernel): 800 (400)
  // thread blocks, more than one wave on a GPU of 132 SMs in every kernel (it holds 396 of the
  // one-warpgroup wgmma kernel, 132 of the two-warpgroup one, 528 of mma.sync's at D = 64).
  const std::vector<std::int64_t> lens{6400, 6400};
  const std::int64_t heads = 4;
  for (const std::int64_t g : {64, 128}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                .block = g,
                                                .p = 0.97,
                                                .causal = causal,
                                                .heads = heads,
                                                .seed = 31},
                                               lens);
      for (const auto& plan : plans_for(mask)) check(plan, {dtype::f16, dtype::f32, 64}, heads, 90);
    }
  }
  const std::vector<std::int64_t> cu{0, 8192};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE("top-k, causal " + std::to_string(causal));
    const topk_mask_options o{.block = 64, .top_k = 2, .causal = causal, .keep_diagonal = true};
    auto plan = topk_block_sparse_plan::build(cu, cu, heads, 64, o);
    host_tensor hq(dtype::f16, cu.back(), heads, 64), hk(dtype::f16, cu.back(), heads, 64),
        hv(dtype::f16, cu.back(), heads, 64);
    hq.fill_uniform(-1, 1, 91);
    hk.fill_uniform(-1, 1, 92);
    hv.fill_uniform(-1, 1, 93);
    test::device_tensor q(hq), k(hk), v(hv), out(host_tensor(dtype::f32, cu.back(), heads, 64));
    plan.select(q.view(), k.view());
    host_tensor got;
    ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
        out, [&] { plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = 0.125}); }, got));
    host_tensor want(dtype::f64, cu.back(), heads, 64);
    reference::block_sparse_attention(plan.mask(), hq.view(), hk.view(), hv.view(), want.view(),
                                      0.125);
    const auto e = test::compare(got, want);
    ASSERT_TRUE(e.finite) << "unwritten or non-finite outputs";
    EXPECT_LE(e.relative(), test::gpu_tolerance(dtype::f16, dtype::f32, 4));
  }
}

// Sequences of 2500 and 16400 rows at G = 16 (157 and 1025 key blocks: keys held in registers,
// and read from shared memory past 1024): random scores (expect_topk_rows), and exact ties (every
// key row equal, so every key block scores the same), where the device takes the lowest blocks as
// topk_block_mask does and the whole mask equals the CPU's. Head dims 24 and 40 leave the last
// group of 16 pooled dims part padding.
TEST(GpuBlockSparse, TopKOverManyKeyBlocks) {
  SKIP_WITHOUT_GPU();
  for (const std::int64_t len : {2500, 16400}) {
    const std::vector<std::int64_t> cu{0, len, len + 100};
    for (const std::int64_t d : {24, 40, 64, 128}) {
      for (const bool causal : {false, true}) {
        SCOPED_TRACE("length " + std::to_string(len) + " d " + std::to_string(d) + " causal " +
                     std::to_string(causal));
        const topk_mask_options o{
            .block = 16, .top_k = 26, .causal = causal, .keep_diagonal = true};
        auto plan = topk_block_sparse_plan::build(cu, cu, 1, d, o);
        host_tensor hq(dtype::bf16, cu.back(), 1, d), hk(dtype::bf16, cu.back(), 1, d);
        hq.fill_uniform(-1, 1, 5);
        for (const bool ties : {false, true}) {
          if (ties)
            hk.fill_uniform(0.25, 0.25, 0);
          else
            hk.fill_uniform(-1, 1, 6);
          test::device_tensor q(hq), k(hk);
          plan.select(q.view(), k.view());
          const block_sparse_mask got = plan.mask();
          if (!ties) {
            ASSERT_NO_FATAL_FAILURE(test::expect_topk_rows(got, hq, hk, o));
            continue;
          }
          const block_sparse_mask want = topk_block_mask(hq.view(), hk.view(), cu, cu, o);
          ASSERT_EQ(got.masks.size(), want.masks.size());
          for (std::size_t i = 0; i < got.masks.size(); ++i) {
            EXPECT_EQ(got.masks[i].blocks.row_ptr, want.masks[i].blocks.row_ptr);
            EXPECT_EQ(got.masks[i].blocks.col_idx, want.masks[i].blocks.col_idx);
          }
        }
      }
    }
  }
}

// A NaN in a key block makes its mean, and its score against every query block, NaN: the device
// never selects it (only as a row's diagonal block), and a row with fewer numbers than top_k takes
// all of them. 5 key blocks (fewer than top_k), 63, and 64 (every key a lane holds attended: NaN's
// found by the keys' extremes); the NaN in head 1 only.
TEST(GpuBlockSparse, TopKLeavesOutNaNScores) {
  SKIP_WITHOUT_GPU();
  const std::int64_t g = 64, d = 64, top_k = 26;
  // Head 1: key block 1 and query block 5 hold a NaN, so every score of row 5 and of column 1
  // is NaN. At 32K (heads 8) the selection blocks take 32 rows, so a warp selects row 5 together
  // with the row 16 below it, which has numbers.
  for (const auto& [len, heads] :
       {std::pair<std::int64_t, std::int64_t>{300, 2}, {4000, 2}, {4096, 2}, {32768, 8}}) {
    SCOPED_TRACE("length " + std::to_string(len) + ", heads " + std::to_string(heads));
    const std::vector<std::int64_t> cu{0, len};
    const topk_mask_options o{.block = g, .top_k = top_k, .causal = false, .keep_diagonal = true};
    host_tensor hq(dtype::f16, len, heads, d), hk(dtype::f16, len, heads, d);
    hq.fill_uniform(-1, 1, 11);
    hk.fill_uniform(-1, 1, 12);
    hk.set(hk.view().offset(g + 3, 1, 5), std::numeric_limits<double>::quiet_NaN());
    const std::int64_t nb = (len + g - 1) / g, nan_row = 5;
    if (nan_row < nb) {
      hq.set(hq.view().offset(nan_row * g + 7, 1, 2), std::numeric_limits<double>::quiet_NaN());
    }
    test::device_tensor q(hq), k(hk);
    auto plan = topk_block_sparse_plan::build(cu, cu, heads, d, o);
    plan.select(q.view(), k.view());
    const block_sparse_mask got = plan.mask();
    for (std::int64_t h = 0; h < heads; ++h) {
      const csr_graph& rows = got.masks[static_cast<std::size_t>(h)].blocks;
      for (std::int64_t r = 0; r < nb; ++r) {
        const std::vector<std::int32_t> cols(rows.col_idx.begin() + rows.row_ptr[r],
                                             rows.col_idx.begin() + rows.row_ptr[r + 1]);
        EXPECT_TRUE(std::is_sorted(cols.begin(), cols.end()));
        const bool diagonal = std::find(cols.begin(), cols.end(), r) != cols.end();
        EXPECT_TRUE(diagonal) << "head " << h << " row " << r;
        const bool nan_query = h == 1 && r == nan_row;
        // The row's scores that are numbers; the diagonal is kept even where it is NaN.
        const std::int64_t numbers = nan_query ? 0 : nb - (h == 1);
        const bool nan_diagonal = h == 1 && (r == 1 || nan_query);
        if (h == 1 && r != 1) {
          EXPECT_EQ(std::find(cols.begin(), cols.end(), 1), cols.end()) << "row " << r;
        }
        if (numbers <= top_k) {
          // Every number, and the diagonal block.
          EXPECT_EQ(static_cast<std::int64_t>(cols.size()), numbers + nan_diagonal)
              << "head " << h << " row " << r;
        } else {
          EXPECT_GE(static_cast<std::int64_t>(cols.size()), top_k);
          EXPECT_LE(static_cast<std::int64_t>(cols.size()), top_k + 1);
        }
      }
    }
  }
}

// Selection blocks of 32 query blocks (two row tiles of the scoring MMA, 16 warps): a sequence
// of 505 query blocks at G = 64 gives 15 groups of 32 and a last one of 25 (its second row tile
// partly empty), a second sequence of 3 blocks one group of 3 (one row tile): 136 selection
// blocks over 8 heads, enough to keep 32 rows a block on a GPU of up to 272 SMs.
TEST(GpuBlockSparse, TopKSelectionBlocksOfTwoRowTiles) {
  SKIP_WITHOUT_GPU();
  const std::int64_t g = 64, heads = 8, d = 64, len = 505 * g - 17;
  const std::vector<std::int64_t> cu{0, len, len + 3 * g};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const topk_mask_options o{.block = g, .top_k = 26, .causal = causal, .keep_diagonal = true};
    auto plan = topk_block_sparse_plan::build(cu, cu, heads, d, o);
    host_tensor hq(dtype::f16, cu.back(), heads, d), hk(dtype::f16, cu.back(), heads, d);
    hq.fill_uniform(-1, 1, causal ? 11 : 12);
    hk.fill_uniform(-1, 1, causal ? 13 : 14);
    test::device_tensor q(hq), k(hk);
    plan.select(q.view(), k.view());
    ASSERT_NO_FATAL_FAILURE(test::expect_topk_rows(plan.mask(), hq, hk, o));
  }
}

// Selection and attention queued back to back with no synchronisation between them (on sm_90 the
// attention is a dependent launch, its blocks placed while the selection still runs): each
// attention uses the mask selected just before it, not the one before that. Two input sets whose
// masks differ are selected in turn; each output equals, to rounding, a plan built from that
// set's downloaded mask. At 4K (4-row selection blocks, one wave, themselves dependents of the
// pooling) and 32K (32-row blocks).
TEST(GpuBlockSparse, TopKSelectThenAttendWithoutSynchronisation) {
  SKIP_WITHOUT_GPU();
  const std::int64_t g = 64, heads = 8, d = 64;
  for (const std::int64_t n : {4096, 32768}) {
    SCOPED_TRACE("N " + std::to_string(n));
    const std::vector<std::int64_t> cu{0, n};
    auto plan = topk_block_sparse_plan::build(cu, cu, heads, d,
                                              {.block = g, .top_k = 26, .keep_diagonal = true});
    const auto random = [&](std::uint64_t seed) {
      host_tensor t(dtype::f16, n, heads, d);
      t.fill_uniform(-1, 1, seed);
      return t;
    };
    test::device_tensor q0(random(n + 1)), k0(random(n + 2)), v0(random(n + 3));
    test::device_tensor q1(random(n + 4)), k1(random(n + 5)), v1(random(n + 6));
    const host_tensor zeros(dtype::f32, n, heads, d);
    test::device_tensor out0(zeros), out1(zeros);
    plan.select(q1.view(), k1.view());
    const block_sparse_mask mask1 = plan.mask();
    plan.select(q0.view(), k0.view());
    const block_sparse_mask mask0 = plan.mask();
    ASSERT_NE(mask0.masks[0].blocks.col_idx, mask1.masks[0].blocks.col_idx)
        << "the two sets must select different masks";
    out0.poison();
    out1.poison();
    // The plan holds mask 0: the first attention would see it if it read the mask early.
    plan.select(q1.view(), k1.view());
    plan.run(q1.view(), k1.view(), v1.view(), out1.view());
    plan.select(q0.view(), k0.view());
    plan.run(q0.view(), k0.view(), v0.view(), out0.view());
    const host_tensor got0 = out0.download(), got1 = out1.download();
    const auto expect_as_planned = [&](const block_sparse_mask& mask, test::device_tensor& q,
                                       test::device_tensor& k, test::device_tensor& v,
                                       const host_tensor& got) {
      test::device_tensor want(zeros);
      cuda_plan(mask).run(q.view(), k.view(), v.view(), want.view());
      const auto e = test::compare(got, want.download());
      EXPECT_TRUE(e.finite);
      EXPECT_LE(e.relative(), 2 * test::gpu_tolerance(dtype::f16, dtype::f32, 4));
    };
    expect_as_planned(mask0, q0, k0, v0, got0);
    expect_as_planned(mask1, q1, k1, v1, got1);
  }
}

block_sparse_attention_plan unfused_plan(const block_sparse_mask& m) {
  auto plan =
      block_sparse_attention_plan::build(m, device_kind::cuda, {.algo = algorithm::unfused});
  EXPECT_EQ(plan.report().algo, algorithm::unfused);
  return plan;
}

// The report's three kernels (cuda_block_unfused): every block size, fine, odd and coarse (the
// SDDMM's tiles of 1 ... 32 rows, the SpMM's of 8, 16, 32), causal and not, shared and per-head
// masks, on a ragged batch; one dtype pair and one odd head dim (8 to 256) per plan, in turn.
TEST(GpuBlockSparse, TheReportsPipelineOnEveryBlockSize) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64};
  std::uint64_t seed = 200;
  std::int64_t nth = 0;  // quick mode: both causal cases, one or two mask heads in turn
  for (const std::int64_t g : {1, 2, 8, 16, 24, 32, 64, 128}) {
    ++nth;
    for (const bool causal : {false, true}) {
      for (const std::int64_t mask_heads : {1, 2}) {
        if (test::quick() && (nth + mask_heads) % 2 != 0) continue;
        const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                  .block = g,
                                                  .p = 0.6,
                                                  .causal = causal,
                                                  .heads = mask_heads,
                                                  .seed = seed++},
                                                 lens);
        const auto plan = unfused_plan(mask);
        check(plan, kConfigs[seed % std::size(kConfigs)], 2, seed);
        ++seed;
        constexpr std::int64_t kDims[] = {8, 40, 128, 256};
        check(plan, {dtype::f16, dtype::f32, kDims[seed % 4]}, 2, seed);
        ++seed;
      }
    }
  }
}

// The pipeline on the fused kernel's edge cases: the report's layouts (one block per row among
// them), a dense mask, empty block rows, rectangular causal sequences where the first queries see
// no key, scores near 1e4, negative and zero scales; and its per-stage timing.
TEST(GpuBlockSparse, TheReportsPipelineOnEdgeCases) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{200, 129, 64};
  const config c{dtype::f16, dtype::f32, 64};
  for (const block_layout l : {block_layout::dense, block_layout::window, block_layout::strided,
                               block_layout::global, block_layout::bigbird}) {
    const auto mask = make_block_sparse_mask({.layout = l,
                                              .block = 16,
                                              .window = l == block_layout::window ? 0 : 1,
                                              .stride = 3,
                                              .causal = l == block_layout::bigbird,
                                              .seed = 9},
                                             lens);
    check(unfused_plan(mask), c, 3, 300 + static_cast<std::uint64_t>(l));
  }
  check(unfused_plan(odd_block_rows_emptied(32, lens)), {dtype::bf16, dtype::bf16, 128}, 2, 310);
  const std::vector<std::int64_t> cu_q{0, 300, 301, 700}, cu_k{0, 100, 400, 700};
  host_tensor hq(dtype::f16, 700, 2, 64), hk(dtype::f16, 700, 2, 64);
  hq.fill_uniform(-1, 1, 1);
  hk.fill_uniform(-1, 1, 2);
  for (const std::int64_t g : {8, 64}) {
    check(unfused_plan(topk_block_mask(hq.view(), hk.view(), cu_q, cu_k,
                                       {.block = g, .top_k = 2, .causal = true})),
          c, 2, 320);
  }
  const auto dense = make_block_sparse_mask({.layout = block_layout::dense, .block = 64}, lens);
  const auto plan = unfused_plan(dense);
  for (const double scale : {100.0, -0.4, -100.0, 0.0}) check(plan, c, 1, 330, scale);
  check(plan, c, 1, 331, 1.0, 0.25, 1.0);
  // Timed stages: the same output as run(), three positive times.
  const std::int64_t n = dense.cu_seqlens_q.back();
  host_tensor x(dtype::f16, n, 2, 64);
  x.fill_uniform(-1, 1, 5);
  test::device_tensor q(x), o(host_tensor(dtype::f32, n, 2, 64));
  o.poison();
  plan.run(q.view(), q.view(), q.view(), o.view());
  const host_tensor want = o.download();
  o.poison();
  const std::array<double, 3> ms = plan.run_timing_stages(q.view(), q.view(), q.view(), o.view());
  const host_tensor got = o.download();
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size_bytes()), 0);
  for (const double t : ms) EXPECT_GT(t, 0.0);
  EXPECT_THROW((void)cuda_plan(dense).run_timing_stages(q.view(), q.view(), q.view(), o.view()),
               invalid_input);
  test::device_tensor odd(host_tensor(dtype::f16, n, 2, 12)),
      odd_out(host_tensor(dtype::f32, n, 2, 12));
  EXPECT_THROW(plan.run(odd.view(), odd.view(), odd.view(), odd_out.view()), invalid_input);
}

TEST(GpuBlockSparse, RejectsWhatItCannotRun) {
  SKIP_WITHOUT_GPU();
  const auto mask = make_block_sparse_mask({.block = 16}, std::vector<std::int64_t>{32});
  const auto plan = cuda_plan(mask);
  const auto run = [&](dtype in, std::int64_t d, dtype out) {
    test::device_tensor q(host_tensor(in, 32, 1, d)), o(host_tensor(out, 32, 1, d));
    plan.run(q.view(), q.view(), q.view(), o.view());
    test::cuda_check(cudaDeviceSynchronize(), "run");
  };
  EXPECT_NO_THROW(run(dtype::f16, 64, dtype::f32));
  EXPECT_THROW(run(dtype::f16, 32, dtype::f32), invalid_input);
  EXPECT_THROW(run(dtype::f32, 64, dtype::f32), not_supported);  // the CPU's and row-wise dtypes
  EXPECT_THROW(run(dtype::f16, 64, dtype::f64), not_supported);
  EXPECT_THROW(block_sparse_attention_plan::build(mask, device_kind::cuda,
                                                  {.algo = algorithm::blocked_reference}),
               invalid_input);
  const auto fine = make_block_sparse_mask({.block = 8}, std::vector<std::int64_t>{32});
  EXPECT_THROW(
      block_sparse_attention_plan::build(fine, device_kind::cuda, {.algo = algorithm::block}),
      not_supported);
  // wgmma takes blocks that are multiples of 64 only, the two-warpgroup kernel multiples of 128
  // (and both sm_90 only).
  EXPECT_THROW(cuda_plan(mask, block_kernel::wgmma), not_supported);
  EXPECT_THROW(cuda_plan(mask, block_kernel::wgmma_pingpong), not_supported);
}

}  // namespace
}  // namespace trisparse
