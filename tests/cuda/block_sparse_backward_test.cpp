// The CUDA block-sparse backward (algorithm::block) against the float64 reference gradients (label
// gpu; skipped without a device): every block size, dtype, head dim and gradient dtype on ragged
// batches with per-head, causal, rectangular and emptied masks; scores near 1e4; N = 65537 and a
// batch of 1024 sequences. The forward writes the lse the backward reads; two backward runs are
// bitwise equal; rows and columns no pair reaches get exact zeros.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "device_tensor.hpp"

namespace trisparse {
namespace {

struct grad_case {
  dtype in, grad;  // q, k, v, dout (and out); dq, dk, dv
  std::int64_t dim, heads;
};

// TRISPARSE_TEST_VERBOSE=1: each case's stages on stdout, as they end.
void stage(const char* what) {
  const char* v = std::getenv("TRISPARSE_TEST_VERBOSE");
  if (v != nullptr && *v == '1') {
    std::printf("[ stage ] %s\n", what);
    std::fflush(stdout);
  }
}

// A mask's blocks as bytes on the device, [masks, query blocks, key blocks] (the longest
// sequence's), for block_sparse_attention_plan's device build.
struct kept_bytes {
  std::unique_ptr<std::uint8_t, decltype(&cudaFree)> data{nullptr, &cudaFree};
  device_block_mask view;

  // shared: one mask serves every sequence (all sequences must then have the same mask).
  kept_bytes(const block_sparse_mask& m, bool shared) {
    std::int64_t rows = 0, cols = 0;
    for (const block_mask& bm : m.masks) {
      rows = std::max(rows, bm.blocks.rows);
      cols = std::max(cols, bm.blocks.cols);
    }
    const std::int64_t stored = shared ? m.heads : m.batch() * m.heads;
    std::vector<std::uint8_t> host(
        static_cast<std::size_t>(std::max<std::int64_t>(stored * rows * cols, 1)), 0);
    for (std::int64_t x = 0; x < stored; ++x) {
      const csr_graph& b = m.masks[static_cast<std::size_t>(x)].blocks;
      for (std::int64_t r = 0; r < b.rows; ++r)
        for (std::int64_t e = b.row_ptr[r]; e < b.row_ptr[r + 1]; ++e)
          host[static_cast<std::size_t>((x * rows + r) * cols + b.col_idx[e])] = 1;
    }
    std::uint8_t* d = nullptr;
    test::cuda_check(cudaMalloc(&d, host.size()), "cudaMalloc");
    data.reset(d);
    test::cuda_check(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
    view = {d, 0, shared ? 0 : m.heads * rows * cols, rows * cols, cols, rows, cols};
  }
};

// The block importance a backward writes on request (attention_options::block_mass, block_grad)
// against the CPU's float64 sums: every kept block, the mass within 2e-3 of the largest, |dS|
// within 2e-2 (bf16) or 4e-3 (f16), as dS takes <dO, O> from the forward's O rounded to q's type
// (as the gradients do); two runs give the same bits, and the gradients stay those of the run
// without it (`grads`). The mass without a backward (block_mass) too, within 1e-4, repeatable.
void check_importance(const block_sparse_mask& m, const block_sparse_attention_plan& plan,
                      const host_tensor& hq, const host_tensor& hk, const host_tensor& hv,
                      const host_tensor& hdo, double scale, const host_tensor (&grads)[3]) {
  const std::int64_t h = hq.view().heads, nq = hq.view().rows, nk = hk.view().rows;
  const std::int64_t dim = hq.view().dim, g = m.block;
  std::int64_t lq = 0, lk = 0;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    lq = std::max(lq, m.len_q(b));
    lk = std::max(lk, m.len_k(b));
  }
  const std::int64_t qb = (lq + g - 1) / g, kb = (lk + g - 1) / g, rows = m.batch() * qb;
  const dtype gt = grads[0].view().type;
  test::device_tensor q(hq), k(hk), v(hv), dout(hdo), out(host_tensor(hq.view().type, nq, h, dim)),
      lse(host_tensor(dtype::f32, nq, h, 1)), dq(host_tensor(gt, nq, h, dim)),
      dk(host_tensor(gt, nk, h, dim)), dv(host_tensor(gt, nk, h, dim)),
      mass(host_tensor(dtype::f32, rows, h, kb)), grad(host_tensor(dtype::f32, rows, h, kb)),
      ws(host_tensor(dtype::f32,
                     static_cast<std::int64_t>(plan.backward_workspace_bytes(h, true) / 4) + 1, 1,
                     1));
  plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale, .lse = lse.view()});
  host_tensor first[2];
  for (int round = 0; round < 2; ++round) {
    mass.poison();
    grad.poison();
    ws.poison();
    plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                  dk.view(), dv.view(),
                  {.scale = scale, .block_mass = mass.view(), .block_grad = grad.view()}, {},
                  {ws.view().data, plan.backward_workspace_bytes(h, true)});
    host_tensor now[2] = {mass.download(), grad.download()};
    if (round == 0) {
      const host_tensor d[3] = {dq.download(), dk.download(), dv.download()};
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(std::memcmp(d[i].data(), grads[i].data(), d[i].size_bytes()), 0)
            << "importance changed the gradients";
      }
      first[0] = std::move(now[0]);
      first[1] = std::move(now[1]);
    } else {
      for (int i = 0; i < 2; ++i) {
        EXPECT_EQ(std::memcmp(first[i].data(), now[i].data(), now[i].size_bytes()), 0)
            << "importance differs between runs: a race";
      }
    }
  }
  // The mass without a backward (block_mass: the light pass), twice.
  host_tensor light;
  {
    const std::size_t bytes = plan.block_mass_workspace_bytes(h);
    test::device_tensor mws(
        host_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1));
    for (int round = 0; round < 2; ++round) {
      mass.poison();
      mws.poison();
      plan.block_mass(q.view(), k.view(), lse.view(), {.scale = scale, .block_mass = mass.view()},
                      {}, {mws.view().data, bytes});
      host_tensor now = mass.download();
      if (round == 0)
        light = std::move(now);
      else
        EXPECT_EQ(std::memcmp(light.data(), now.data(), now.size_bytes()), 0)
            << "block_mass differs between runs: a race";
    }
  }
  host_tensor want[2] = {host_tensor(dtype::f64, rows, h, kb),
                         host_tensor(dtype::f64, rows, h, kb)};
  const auto cpu = block_sparse_attention_plan::build(m, device_kind::cpu);
  host_tensor dqc(dtype::f32, nq, h, dim), dkc(dtype::f32, nk, h, dim), dvc(dtype::f32, nk, h, dim);
  cpu.backward(hq.view(), hk.view(), hv.view(), {}, {}, hdo.view(), dqc.view(), dkc.view(),
               dvc.view(),
               {.scale = scale, .block_mass = want[0].view(), .block_grad = want[1].view()});
  // The light pass sums P in fp32 from the lse (no rounding to q's type): tighter.
  const char* names[3] = {"block_mass", "block_grad", "block_mass without a backward"};
  const host_tensor* measured[3] = {&first[0], &first[1], &light};
  for (int i = 0; i < 3; ++i) {
    const host_tensor& ref_of = want[i == 1 ? 1 : 0];
    double top = 0.0, err = 0.0;
    std::int64_t bad = 0;
    for (std::int64_t b = 0; b < m.batch(); ++b) {
      for (std::int64_t x = 0; x < h; ++x) {
        const csr_graph& blocks = m.at(b, x).blocks;
        for (std::int64_t r = 0; r < blocks.rows; ++r) {
          for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
            const std::int64_t at = measured[i]->view().offset(b * qb + r, x, blocks.col_idx[e]);
            const double got = measured[i]->get(at), ref = ref_of.get(at);
            bad += !std::isfinite(got);
            top = std::max(top, std::abs(ref));
            err = std::max(err, std::abs(got - ref));
          }
        }
      }
    }
    EXPECT_EQ(bad, 0) << names[i] << ": kept blocks unwritten or not finite";
    const double tol = i == 0   ? 2e-3
                       : i == 2 ? 1e-4
                                : (hq.view().type == dtype::bf16 ? 2e-2 : 4e-3);
    EXPECT_LE(err, tol * top + 1e-6) << names[i] << ": largest " << top;
  }
}

// on_device: the plan is built from the mask's blocks as bytes on the device (kept_bytes), with
// `shared` as there; with `built_from`, built from that mask's bytes (the same layout) and then
// refilled from m's.
void check(const block_sparse_mask& m, const grad_case& c, std::uint64_t seed, double lo = -1.0,
           double hi = 1.0, double scale = 0.125, bool on_device = false, bool shared = false,
           const block_sparse_mask* built_from = nullptr) {
  std::unique_ptr<kept_bytes> kept;
  block_sparse_attention_plan plan;
  if (on_device) {
    kept = std::make_unique<kept_bytes>(m, shared);
    block_sparse_mask layout = m;
    layout.masks.clear();
    if (built_from != nullptr) {
      const kept_bytes before(*built_from, shared);
      plan = block_sparse_attention_plan::build(layout, before.view, {.gradients = true});
      plan.refill(kept->view);
    } else {
      plan = block_sparse_attention_plan::build(layout, kept->view, {.gradients = true});
    }
  } else {
    plan = block_sparse_attention_plan::build(m, device_kind::cuda, {.gradients = true});
  }
  SCOPED_TRACE(std::string(to_string(c.in)) + "->" + std::string(to_string(c.grad)) + " d" +
               std::to_string(c.dim) + " heads " + std::to_string(c.heads) + "/" +
               std::to_string(m.heads) + " G" + std::to_string(m.block) + " causal " +
               std::to_string(m.causal) + " scale " + std::to_string(scale) + " " +
               plan.report().format);
  ASSERT_EQ(plan.report().algo, algorithm::block);
  const std::int64_t nq = m.cu_seqlens_q.back(), nk = m.cu_seqlens_k.back(), h = c.heads;
  host_tensor hq(c.in, nq, h, c.dim), hk(c.in, nk, h, c.dim), hv(c.in, nk, h, c.dim),
      hdo(c.in, nq, h, c.dim);
  hq.fill_uniform(lo, hi, seed);
  hk.fill_uniform(lo, hi, seed + 1);
  hv.fill_uniform(-1.0, 1.0, seed + 2);
  hdo.fill_uniform(-1.0, 1.0, seed + 3);
  test::device_tensor q(hq), k(hk), v(hv), dout(hdo), out(host_tensor(c.in, nq, h, c.dim)),
      lse(host_tensor(dtype::f32, nq, h, 1));
  out.poison();
  lse.poison();
  stage("plan built, inputs uploaded");
  plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale, .lse = lse.view()});
  test::cuda_check(cudaDeviceSynchronize(), "forward");
  stage("forward");
  {
    host_tensor want(dtype::f64, nq, h, c.dim);
    reference::block_sparse_attention(m, hq.view(), hk.view(), hv.view(), want.view(), scale);
    const auto e = test::compare(out.download(), want);
    EXPECT_TRUE(e.finite) << "out: unwritten, NaN or infinite";
    EXPECT_LE(e.relative(), test::gpu_tolerance(c.in, c.in, 8)) << "out: max abs " << e.max_abs;
  }
  test::device_tensor dq(host_tensor(c.grad, nq, h, c.dim)), dk(host_tensor(c.grad, nk, h, c.dim)),
      dv(host_tensor(c.grad, nk, h, c.dim));
  host_tensor got[3];
  for (int round = 0; round < 2; ++round) {
    for (auto* g : {&dq, &dk, &dv}) g->poison();
    plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                  dk.view(), dv.view(), {.scale = scale});
    host_tensor now[3] = {dq.download(), dk.download(), dv.download()};
    stage("backward");
    for (int i = 0; i < 3; ++i) {
      if (round == 0) {
        got[i] = std::move(now[i]);
      } else {
        EXPECT_EQ(std::memcmp(got[i].data(), now[i].data(), now[i].size_bytes()), 0)
            << "runs differ: a race";
      }
    }
  }
  host_tensor want[3] = {host_tensor(dtype::f64, nq, h, c.dim),
                         host_tensor(dtype::f64, nk, h, c.dim),
                         host_tensor(dtype::f64, nk, h, c.dim)};
  reference::block_sparse_attention_backward(m, hq.view(), hk.view(), hv.view(), hdo.view(),
                                             want[0].view(), want[1].view(), want[2].view(), scale);
  stage("reference");
  const double tol = test::gpu_tolerance(c.in, c.grad, 8);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    const auto e = test::compare(got[i], want[i]);
    EXPECT_TRUE(e.finite) << names[i] << ": unwritten, NaN or infinite";
    EXPECT_LE(e.relative(), tol) << names[i] << ": max abs " << e.max_abs << " of " << e.max_ref;
  }
  // Query rows with no key: dq exactly 0; keys no query sees: dk and dv exactly 0.
  std::int64_t wrong = 0;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    for (std::int64_t x = 0; x < h; ++x) {
      const csr_graph pattern = m.expand(b, m.heads == 1 ? 0 : x);
      std::vector<char> seen(static_cast<std::size_t>(pattern.cols), 0);
      for (const std::int32_t j : pattern.col_idx) seen[static_cast<std::size_t>(j)] = 1;
      for (std::int64_t d = 0; d < c.dim; ++d) {
        for (std::int64_t i = 0; i < pattern.rows; ++i)
          if (pattern.degree(i) == 0)
            wrong += got[0].get(got[0].view().offset(m.cu_seqlens_q[b] + i, x, d)) != 0.0;
        for (std::int64_t j = 0; j < pattern.cols; ++j)
          if (seen[static_cast<std::size_t>(j)] == 0)
            for (int g = 1; g < 3; ++g)
              wrong += got[g].get(got[g].view().offset(m.cu_seqlens_k[b] + j, x, d)) != 0.0;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "rows and columns no pair reaches must get exact zeros";
  if (plan.report().nnz * h <= 20'000'000) check_importance(m, plan, hq, hk, hv, hdo, scale, got);
}

// Every block size x causal, on a ragged batch (lengths 0, 1, not multiples of G) with per-head
// random masks, one of them with every odd block row emptied.
TEST(GpuBlockSparseBackward, EveryBlockSizeCausalOrNot) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64};
  std::uint64_t seed = 1;
  for (const std::int64_t g : {16, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                          .block = g,
                                          .p = 0.5,
                                          .causal = causal,
                                          .heads = 2,
                                          .seed = seed++},
                                         lens);
      block_mask& emptied = mask.masks[3];  // sequence 1, head 1: odd block rows keep nothing
      csr_graph kept{.rows = emptied.blocks.rows, .cols = emptied.blocks.cols};
      kept.row_ptr = {0};
      for (std::int64_t r = 0; r < kept.rows; ++r) {
        if (r % 2 == 0)
          for (std::int64_t e = emptied.blocks.row_ptr[r]; e < emptied.blocks.row_ptr[r + 1]; ++e)
            kept.col_idx.push_back(emptied.blocks.col_idx[e]);
        kept.row_ptr.push_back(kept.nnz());
      }
      emptied.blocks = kept;
      // One dtype, head dim and gradient dtype per mask, in turn (every combination on small
      // masks: tests/generic).
      const std::int64_t nth = (g / 16) + (causal ? 1 : 0);
      const dtype in = nth % 2 ? dtype::bf16 : dtype::f16;
      check(mask, {in, (nth / 2) % 2 ? in : dtype::f32, nth % 3 ? 64 : 128, 2}, seed++);
    }
  }
}

// Rectangular sequences (more queries than keys and fewer) with a shared causal mask over 3 heads,
// scores near +-1e4 (|q|, |k| up to 30), and a negative scale.
TEST(GpuBlockSparseBackward, RectangularSharedMasksAndLargeScores) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> cu_q{0, 300, 301, 700}, cu_k{0, 100, 400, 700};
  for (const std::int64_t g : {16, 64, 128}) {
    host_tensor q(dtype::f16, 700, 1, 64), k(dtype::f16, 700, 1, 64);
    q.fill_uniform(-1, 1, 1);
    k.fill_uniform(-1, 1, 2);
    for (const bool causal : {true, false}) {
      const auto mask = topk_block_mask(q.view(), k.view(), cu_q, cu_k,
                                        {.block = g, .top_k = 2, .causal = causal});
      check(mask, {dtype::f16, dtype::f32, 64, 3}, 21);
      check(mask, {dtype::bf16, dtype::f32, 128, 1}, 22, -30.0, 30.0);
      check(mask, {dtype::f16, dtype::f16, 64, 2}, 23, -1.0, 1.0, -0.3);  // a negative scale
    }
  }
}

// N = 65537 in one sequence, and a batch of 1024 short sequences (1 to 100 rows).
TEST(GpuBlockSparseBackward, LongSequenceAndManySequences) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> one{65537};
  check(make_block_sparse_mask(
            {.layout = block_layout::random, .block = 64, .p = 0.997, .causal = true, .seed = 5},
            one),
        {dtype::bf16, dtype::bf16, 64, 1}, 31);
  std::vector<std::int64_t> many;
  rng r(6);
  for (int b = 0; b < 1024; ++b) many.push_back(1 + static_cast<std::int64_t>(r.below(100)));
  check(make_block_sparse_mask(
            {.layout = block_layout::random, .block = 32, .p = 0.6, .heads = 2, .seed = 7}, many),
        {dtype::f16, dtype::f16, 64, 2}, 32);
}

// Masks held on the device (the plan's lists written by kernels from the mask's bytes): ragged,
// per head, with emptied block rows, causal and not, every block size; a shared mask over a
// batch; rectangular top-k masks.
TEST(GpuBlockSparseBackward, MasksOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64};
  std::uint64_t seed = 41;
  for (const std::int64_t g : {16, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                .block = g,
                                                .p = 0.6,
                                                .causal = causal,
                                                .heads = 2,
                                                .seed = seed++},
                                               lens);
      check(mask, {dtype::f16, dtype::f32, 64, 2}, seed++, -1.0, 1.0, 0.125, true);
      check(mask, {dtype::bf16, dtype::bf16, 128, 2}, seed++, -1.0, 1.0, 0.125, true);
    }
  }
  // One mask for three sequences of one length, shared by 2 heads.
  const std::vector<std::int64_t> same{200, 200, 200};
  auto shared = make_block_sparse_mask(
      {.layout = block_layout::random, .block = 64, .p = 0.5, .seed = 9}, same);
  for (block_mask& bm : shared.masks) bm = shared.masks.front();
  check(shared, {dtype::f16, dtype::f16, 64, 2}, 51, -1.0, 1.0, 0.125, true, true);
  const std::vector<std::int64_t> cu_q{0, 300, 301, 700}, cu_k{0, 100, 400, 700};
  host_tensor q(dtype::f16, 700, 1, 64), k(dtype::f16, 700, 1, 64);
  q.fill_uniform(-1, 1, 1);
  k.fill_uniform(-1, 1, 2);
  const auto topk =
      topk_block_mask(q.view(), k.view(), cu_q, cu_k, {.block = 64, .top_k = 2, .causal = true});
  check(topk, {dtype::bf16, dtype::f32, 128, 1}, 52, -30.0, 30.0, 0.125, true);
}

// A plan built from one mask on the device and refilled from another of the same layout (a
// pattern pruned again in place): forward and gradients those of the second mask; refill refuses
// a plan built from a host mask and bytes of another layout.
TEST(GpuBlockSparseBackward, RefilledFromAnotherMaskOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{1, 300, 0, 517, 64};
  std::uint64_t seed = 71;
  for (const std::int64_t g : {16, 64, 128}) {
    for (const bool causal : {false, true}) {
      const auto make = [&](double p) {
        return make_block_sparse_mask({.layout = block_layout::random,
                                       .block = g,
                                       .p = p,
                                       .causal = causal,
                                       .heads = 2,
                                       .seed = seed++},
                                      lens);
      };
      const auto first = make(0.8), second = make(0.4);
      check(second, {dtype::f16, dtype::f32, 64, 2}, seed++, -1.0, 1.0, 0.125, true, false, &first);
      check(first, {dtype::bf16, dtype::bf16, 128, 2}, seed++, -1.0, 1.0, 0.125, true, false,
            &second);
    }
  }
  const auto mask = make_block_sparse_mask({.layout = block_layout::random, .block = 64}, lens);
  const kept_bytes kept(mask, false);
  const auto host_plan =
      block_sparse_attention_plan::build(mask, device_kind::cuda, {.gradients = true});
  EXPECT_THROW(host_plan.refill(kept.view), invalid_input);
  block_sparse_mask layout = mask;
  layout.masks.clear();
  const auto plan = block_sparse_attention_plan::build(layout, kept.view, {.gradients = true});
  device_block_mask other = kept.view;
  other.cols += 1;
  other.row_stride += 1;
  EXPECT_THROW(plan.refill(other), invalid_input);
}

// The top-k plan's backward: the transposed masks rebuilt on the device after each selection,
// gradients against the float64 reference under the selected mask, bitwise equal over two
// selections of the same mask.
TEST(GpuBlockSparseBackward, TopkPlanOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> cu_q{0, 300, 301, 1000, 1000}, cu_k{0, 257, 400, 1400, 1464};
  for (const bool causal : {false, true}) {
    for (const std::int64_t g : {32, 64}) {
      SCOPED_TRACE("causal " + std::to_string(causal) + " G" + std::to_string(g));
      const std::int64_t h = 2, d = 64, nq = cu_q.back(), nk = cu_k.back();
      auto plan = topk_block_sparse_plan::build(
          cu_q, cu_k, h, d, {.block = g, .top_k = 3, .causal = causal}, {.gradients = true});
      host_tensor hq(dtype::f16, nq, h, d), hk(dtype::f16, nk, h, d), hv(dtype::f16, nk, h, d),
          hdo(dtype::f16, nq, h, d);
      hq.fill_uniform(-1, 1, 61);
      hk.fill_uniform(-1, 1, 62);
      hv.fill_uniform(-1, 1, 63);
      hdo.fill_uniform(-1, 1, 64);
      test::device_tensor q(hq), k(hk), v(hv), dout(hdo), out(host_tensor(dtype::f16, nq, h, d)),
          lse(host_tensor(dtype::f32, nq, h, 1)), dq(host_tensor(dtype::f32, nq, h, d)),
          dk(host_tensor(dtype::f32, nk, h, d)), dv(host_tensor(dtype::f32, nk, h, d)),
          ws(host_tensor(dtype::f32,
                         static_cast<std::int64_t>(plan.backward_workspace_bytes(h) / 4) + 1, 1,
                         1));
      const workspace_view w{ws.view().data, plan.backward_workspace_bytes(h)};
      host_tensor first[3];
      for (int round = 0; round < 2; ++round) {
        for (auto* g2 : {&out, &lse, &dq, &dk, &dv}) g2->poison();
        plan.select(q.view(), k.view());
        plan.run(q.view(), k.view(), v.view(), out.view(), {.lse = lse.view()});
        plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                      dk.view(), dv.view(), w);
        host_tensor now[3] = {dq.download(), dk.download(), dv.download()};
        for (int i = 0; i < 3; ++i) {
          if (round == 0)
            first[i] = std::move(now[i]);
          else
            EXPECT_EQ(std::memcmp(first[i].data(), now[i].data(), now[i].size_bytes()), 0)
                << "runs differ";
        }
      }
      const block_sparse_mask m = plan.mask();
      host_tensor want[3] = {host_tensor(dtype::f64, nq, h, d), host_tensor(dtype::f64, nk, h, d),
                             host_tensor(dtype::f64, nk, h, d)};
      reference::block_sparse_attention_backward(m, hq.view(), hk.view(), hv.view(), hdo.view(),
                                                 want[0].view(), want[1].view(), want[2].view(),
                                                 1.0 / 8.0);
      const char* names[3] = {"dq", "dk", "dv"};
      for (int i = 0; i < 3; ++i) {
        const auto e = test::compare(first[i], want[i]);
        EXPECT_TRUE(e.finite) << names[i] << ": unwritten, NaN or infinite";
        EXPECT_LE(e.relative(), test::gpu_tolerance(dtype::f16, dtype::f32, 8))
            << names[i] << ": max abs " << e.max_abs << " of " << e.max_ref;
      }
      // The mass without a backward under the selected mask: the CPU's float64 masses.
      std::int64_t lq = 0, lk = 0;
      for (std::int64_t b = 0; b < m.batch(); ++b) {
        lq = std::max(lq, m.len_q(b));
        lk = std::max(lk, m.len_k(b));
      }
      const std::int64_t qb = (lq + g - 1) / g, kb = (lk + g - 1) / g;
      const std::size_t bytes = plan.block_mass_workspace_bytes(h);
      test::device_tensor mass(host_tensor(dtype::f32, m.batch() * qb, h, kb)),
          mws(host_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1));
      mass.poison();
      mws.poison();
      plan.block_mass(q.view(), k.view(), lse.view(), {mws.view().data, bytes},
                      {.block_mass = mass.view()});
      const host_tensor got = mass.download();
      host_tensor ref(dtype::f64, m.batch() * qb, h, kb);
      block_sparse_attention_plan::build(m, device_kind::cpu)
          .block_mass(hq.view(), hk.view(), {}, {.scale = 1.0 / 8.0, .block_mass = ref.view()});
      double top = 0.0, err = 0.0;
      for (std::int64_t b = 0; b < m.batch(); ++b) {
        for (std::int64_t x = 0; x < h; ++x) {
          const csr_graph& blocks = m.at(b, x).blocks;
          for (std::int64_t r = 0; r < blocks.rows; ++r) {
            for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
              const std::int64_t at = got.view().offset(b * qb + r, x, blocks.col_idx[e]);
              top = std::max(top, std::abs(ref.get(at)));
              err = std::max(err, std::abs(got.get(at) - ref.get(at)));
            }
          }
        }
      }
      EXPECT_LE(err, 1e-4 * top + 1e-6) << "block_mass: largest " << top;
    }
  }
  const std::vector<std::int64_t> cu{0, 128};
  auto no_grad = topk_block_sparse_plan::build(cu, cu, 1, 64, {.block = 64, .top_k = 1});
  host_tensor hx(dtype::f16, 128, 1, 64);
  test::device_tensor x(hx), lse(host_tensor(dtype::f32, 128, 1, 1));
  no_grad.select(x.view(), x.view());
  EXPECT_THROW(no_grad.backward(x.view(), x.view(), x.view(), x.view(), lse.view(), x.view(),
                                x.view(), x.view(), x.view(), {}),
               invalid_input);
}

TEST(GpuBlockSparseBackward, RejectsWhatItCannotRun) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> lens{128};
  const auto mask = make_block_sparse_mask({.layout = block_layout::random, .block = 64}, lens);
  host_tensor hx(dtype::f16, 128, 1, 64);
  test::device_tensor x(hx), lse(host_tensor(dtype::f32, 128, 1, 1));
  const auto no_grad = block_sparse_attention_plan::build(mask, device_kind::cuda);
  EXPECT_THROW(no_grad.backward(x.view(), x.view(), x.view(), x.view(), lse.view(), x.view(),
                                x.view(), x.view(), x.view()),
               invalid_input);
  const auto plan =
      block_sparse_attention_plan::build(mask, device_kind::cuda, {.gradients = true});
  EXPECT_THROW(plan.backward(x.view(), x.view(), x.view(), x.view(), {}, x.view(), x.view(),
                             x.view(), x.view()),
               invalid_input);
  const auto fine = block_sparse_attention_plan::build(
      make_block_sparse_mask({.layout = block_layout::random, .block = 8}, lens), device_kind::cuda,
      {.gradients = true});
  EXPECT_THROW(fine.backward(x.view(), x.view(), x.view(), x.view(), lse.view(), x.view(), x.view(),
                             x.view(), x.view()),
               not_supported);
}

}  // namespace
}  // namespace trisparse
