// Attention within segments on CUDA (label gpu; skipped without a device): forward (out, lse) and
// backward (dq, dk, dv) against the float64 reference over the segments' block-diagonal pattern,
// for f16 and bf16, head dims 16 - 128, int32 and int64 ids; segments of one row, empty ids
// (gaps), segments longer than a tile, rows not a multiple of the tile; a bias per edge (repeated
// edges); outputs and workspaces poisoned, bitwise repeatable; bad arguments named.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../bias_problem.hpp"
#include "device_tensor.hpp"
#include "trisparse/ops/segment_attention.hpp"

namespace trisparse {
namespace {

// Segment lengths: short graphs (1 - 40 rows) with one of 150 and one of 300 rows (several key
// tiles), in random order; ids skip a value now and then (an empty segment).
std::vector<std::int64_t> random_ids(std::int64_t segments, std::uint64_t seed) {
  rng r(seed);
  std::vector<std::int64_t> ids;
  std::int64_t id = 0;
  for (std::int64_t s = 0; s < segments; ++s) {
    std::int64_t len = 1 + static_cast<std::int64_t>(r.below(40));
    if (s == segments / 3) len = 150;
    if (s == 2 * segments / 3) len = 300;
    ids.insert(ids.end(), static_cast<std::size_t>(len), id);
    id += 1 + (r.below(5) == 0 ? 1 : 0);
  }
  return ids;
}

// The block-diagonal pattern of sorted ids.
csr_graph pattern_of(const std::vector<std::int64_t>& ids) {
  coo_graph coo;
  coo.rows = coo.cols = static_cast<std::int64_t>(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i)
    for (std::size_t j = 0; j < ids.size(); ++j)
      if (ids[i] == ids[j]) {
        coo.src.push_back(static_cast<std::int64_t>(i));
        coo.dst.push_back(static_cast<std::int64_t>(j));
      }
  return to_csr(coo);
}

using test::expect_close;

struct config {
  dtype type;
  std::int64_t heads, dim;
  bool ids_64;
};

void check(const std::vector<std::int64_t>& ids, const config& c, std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(c.type)) + " h" + std::to_string(c.heads) + " d" +
               std::to_string(c.dim) + (c.ids_64 ? " int64" : " int32"));
  const auto rows = static_cast<std::int64_t>(ids.size());
  const csr_graph g = pattern_of(ids);
  const double scale = 0.9 / std::sqrt(static_cast<double>(c.dim));
  const test::qkv x = test::random_qkv(g, c.heads, c.dim, c.type, seed);
  host_tensor dout_h(c.type, rows, c.heads, c.dim);
  dout_h.fill_uniform(-1.0, 1.0, seed + 5);
  host_tensor want_out(dtype::f64, rows, c.heads, c.dim), want_lse(dtype::f64, rows, c.heads, 1),
      want_dq(dtype::f64, rows, c.heads, c.dim), want_dk(dtype::f64, rows, c.heads, c.dim),
      want_dv(dtype::f64, rows, c.heads, c.dim);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), want_out.view(), scale,
                       want_lse.view());
  reference::attention_backward(g, x.q.view(), x.k.view(), x.v.view(), dout_h.view(),
                                want_dq.view(), want_dk.view(), want_dv.view(), scale);

  // The ids on the device, as int64 or int32 (an f32 / f64 host tensor's bytes carry them).
  host_tensor ids_h(c.ids_64 ? dtype::f64 : dtype::f32, rows, 1, 1);
  for (std::int64_t i = 0; i < rows; ++i) {
    if (c.ids_64)
      std::memcpy(ids_h.data() + 8 * i, &ids[static_cast<std::size_t>(i)], 8);
    else {
      const auto v = static_cast<std::int32_t>(ids[static_cast<std::size_t>(i)]);
      std::memcpy(ids_h.data() + 4 * i, &v, 4);
    }
  }
  test::device_tensor ids_d(ids_h);
  const auto plan = segment_attention_plan::build({rows, ids_d.view().data, c.ids_64, 0});
  test::device_tensor q(x.q), k(x.k), v(x.v), dout(dout_h);
  test::device_tensor out(host_tensor(c.type, rows, c.heads, c.dim)),
      lse(host_tensor(dtype::f32, rows, c.heads, 1));
  const std::size_t fwd_bytes = plan.workspace_bytes(),
                    bwd_bytes = plan.backward_workspace_bytes(c.heads);
  test::device_tensor ws(host_tensor(
      dtype::f32, static_cast<std::int64_t>(std::max(fwd_bytes, bwd_bytes) / 4 + 1), 1, 1));
  host_tensor got_out;
  test::run_twice_identically(
      out,
      [&] {
        lse.poison();
        ws.poison();
        plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale, .lse = lse.view()},
                 {ws.view().data, fwd_bytes});
      },
      got_out);
  expect_close(got_out, want_out, test::gpu_tolerance(c.type, c.type, 8), "out");
  expect_close(lse.download(), want_lse, 1e-5, "lse");

  test::device_tensor dq(host_tensor(c.type, rows, c.heads, c.dim)),
      dk(host_tensor(c.type, rows, c.heads, c.dim)), dv(host_tensor(c.type, rows, c.heads, c.dim));
  host_tensor got_dk;
  test::run_twice_identically(
      dk,
      [&] {
        for (test::device_tensor* t : {&dq, &dv, &ws}) t->poison();
        plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                      dk.view(), dv.view(), {.scale = scale}, {ws.view().data, bwd_bytes});
      },
      got_dk);
  const double gtol = test::gpu_tolerance(c.type, c.type, 16);
  expect_close(dq.download(), want_dq, gtol, "dq");
  expect_close(got_dk, want_dk, gtol, "dk");
  expect_close(dv.download(), want_dv, gtol, "dv");
}

TEST(GpuSegmentAttention, ForwardAndBackwardMatchTheReference) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> ids = random_ids(60, 11);
  // Every head dim, the dtypes in turn (both at every dim: tests/generic).
  for (const std::int64_t dim : {16, 32, 64, 128})
    check(ids, {dim % 64 ? dtype::f16 : dtype::bf16, 3, dim, dim % 32 == 0}, 100);
  check(random_ids(5, 12), {dtype::bf16, 1, 64, false}, 200);
  check(std::vector<std::int64_t>(70, 4), {dtype::f16, 2, 32, true}, 300);  // one segment
}

// The ids (int64) on the device: an f64 host tensor's bytes carry them.
test::device_tensor device_ids(const std::vector<std::int64_t>& ids) {
  host_tensor h(dtype::f64, static_cast<std::int64_t>(ids.size()), 1, 1);
  std::memcpy(h.data(), ids.data(), ids.size() * 8);
  return test::device_tensor(h);
}

// Edges (dst = query, src = key) as segment_edges' packed int32 lists, on the device: by query
// (keys rising, copies in edge order), then by key (queries rising).
test::device_tensor edge_lists(std::int64_t rows, const std::vector<std::int64_t>& dst,
                               const std::vector<std::int64_t>& src) {
  const auto edges = static_cast<std::int64_t>(dst.size());
  std::vector<std::int32_t> packed;
  for (const bool by_key : {false, true}) {
    const auto& mine = by_key ? src : dst;
    const auto& other = by_key ? dst : src;
    std::vector<std::int64_t> order(dst.size());
    for (std::size_t e = 0; e < order.size(); ++e) order[e] = static_cast<std::int64_t>(e);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return std::pair(mine[a], other[a]) < std::pair(mine[b], other[b]);
    });
    std::vector<std::int32_t> ptr(static_cast<std::size_t>(rows) + 1, 0);
    for (const std::int64_t e : order) ++ptr[static_cast<std::size_t>(mine[e]) + 1];
    for (std::size_t i = 0; i < static_cast<std::size_t>(rows); ++i) ptr[i + 1] += ptr[i];
    packed.insert(packed.end(), ptr.begin(), ptr.end());
    for (const std::int64_t e : order) packed.push_back(static_cast<std::int32_t>(other[e]));
    for (const std::int64_t e : order) packed.push_back(static_cast<std::int32_t>(e));
  }
  EXPECT_EQ(static_cast<std::int64_t>(packed.size()), 2 * (rows + 1) + 4 * edges);
  host_tensor h(dtype::f32, static_cast<std::int64_t>(packed.size()), 1, 1);
  std::memcpy(h.data(), packed.data(), packed.size() * 4);
  return test::device_tensor(h);
}

// A bias per edge: every pair of the block-diagonal pattern an edge (its entry's bias), every
// seventh pair a second edge of its own bias (the pair takes their sum, each its dS), in a
// shuffled order; against the float64 reference with the summed bias per entry: out, lse, dq, dk,
// dv and every edge's gradient, twice identically.
TEST(GpuSegmentAttention, EdgeBiasMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> ids = random_ids(30, 21);
  const auto rows = static_cast<std::int64_t>(ids.size());
  const csr_graph g = pattern_of(ids);
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared" : "per head");
    const std::int64_t heads = 2, dim = 64, hb = shared ? 1 : heads;
    const double scale = 0.125;
    const test::biased_problem base =
        test::make_biased_problem(g, heads, dim, dtype::bf16, shared, scale, 31);
    // The edges: entry e, and a copy of every seventh entry, shuffled; the bias split between them.
    std::vector<std::int64_t> entry_of;
    for (std::int64_t e = 0; e < g.nnz(); ++e) {
      entry_of.push_back(e);
      if (e % 7 == 0) entry_of.push_back(e);
    }
    rng r(5);
    for (std::size_t i = entry_of.size(); i > 1; --i)
      std::swap(entry_of[i - 1], entry_of[static_cast<std::size_t>(r.below(i))]);
    const auto edges = static_cast<std::int64_t>(entry_of.size());
    std::vector<std::int64_t> dst(entry_of.size()), src(entry_of.size()), row_of(g.nnz());
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t e = g.row_ptr[i]; e < g.row_ptr[i + 1]; ++e) row_of[e] = i;
    host_tensor edge_bias(dtype::f32, edges, hb, 1), entry_bias(dtype::f32, g.nnz(), hb, 1);
    edge_bias.fill_uniform(-3.0, 3.0, 41);
    for (std::int64_t e = 0; e < edges; ++e) {
      const std::int64_t at = entry_of[static_cast<std::size_t>(e)];
      dst[static_cast<std::size_t>(e)] = row_of[at];
      src[static_cast<std::size_t>(e)] = g.col_idx[at];
      for (std::int64_t h = 0; h < hb; ++h)
        entry_bias.set(at * hb + h, entry_bias.get(at * hb + h) + edge_bias.get(e * hb + h));
    }
    host_tensor out_w(dtype::f64, rows, heads, dim), lse_w(dtype::f64, rows, heads, 1),
        dq_w(dtype::f64, rows, heads, dim), dk_w(dtype::f64, rows, heads, dim),
        dv_w(dtype::f64, rows, heads, dim), dbias_w(dtype::f64, g.nnz(), heads, 1);
    reference::attention(g, base.q.view(), base.k.view(), base.v.view(), out_w.view(), scale,
                         lse_w.view(), entry_bias.view());
    host_tensor dout16(dtype::bf16, rows, heads, dim);  // dout in q's dtype, as the plan takes it
    for (std::int64_t i = 0; i < dout16.numel(); ++i) dout16.set(i, base.dout.get(i));
    reference::attention_backward(g, base.q.view(), base.k.view(), base.v.view(), dout16.view(),
                                  dq_w.view(), dk_w.view(), dv_w.view(), scale, dbias_w.view(),
                                  entry_bias.view());
    host_tensor dedge_w(dtype::f64, edges, heads, 1);  // each edge: its entry's dS
    for (std::int64_t e = 0; e < edges; ++e)
      for (std::int64_t h = 0; h < heads; ++h)
        dedge_w.set(e * heads + h, dbias_w.get(entry_of[static_cast<std::size_t>(e)] * heads + h));

    test::device_tensor ids_d = device_ids(ids), lists = edge_lists(rows, dst, src);
    const auto plan = segment_attention_plan::build(
        {rows, ids_d.view().data, true, 0},
        packed_segment_edges(static_cast<const std::int32_t*>(lists.view().data), rows, edges));
    test::device_tensor q(base.q), k(base.k), v(base.v), dout(dout16), bias(edge_bias);
    test::device_tensor out(host_tensor(dtype::bf16, rows, heads, dim)),
        lse(host_tensor(dtype::f32, rows, heads, 1)),
        dedge(host_tensor(dtype::f32, edges, heads, 1));
    const std::size_t bytes = plan.backward_workspace_bytes(heads);
    test::device_tensor ws(host_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4 + 1), 1, 1));
    host_tensor got_out;
    test::run_twice_identically(
        out,
        [&] {
          plan.run(q.view(), k.view(), v.view(), out.view(),
                   {.scale = scale, .lse = lse.view(), .bias = bias.view()},
                   {ws.view().data, bytes});
        },
        got_out);
    expect_close(got_out, out_w, test::gpu_tolerance(dtype::bf16, dtype::bf16, 8), "out");
    expect_close(lse.download(), lse_w, 1e-5, "lse");
    test::device_tensor dq(host_tensor(dtype::bf16, rows, heads, dim)),
        dk(host_tensor(dtype::bf16, rows, heads, dim)),
        dv(host_tensor(dtype::bf16, rows, heads, dim));
    host_tensor got_dedge;
    test::run_twice_identically(
        dedge,
        [&] {
          for (test::device_tensor* t : {&dq, &dk, &dv}) t->poison();
          plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(),
                        dq.view(), dk.view(), dv.view(),
                        {.scale = scale, .bias = bias.view(), .dbias = dedge.view()},
                        {ws.view().data, bytes});
        },
        got_dedge);
    const double gtol = test::gpu_tolerance(dtype::bf16, dtype::bf16, 16);
    expect_close(dq.download(), dq_w, gtol, "dq");
    expect_close(dk.download(), dk_w, gtol, "dk");
    expect_close(dv.download(), dv_w, gtol, "dv");
    expect_close(got_dedge, dedge_w, gtol, "dedge");
  }
  // Lists missing where query_ptr is set, a bias not [E, H or 1, 1]: named.
  test::device_tensor ids_d = device_ids(ids);
  segment_edges partial{};
  partial.query_ptr = static_cast<const std::int32_t*>(ids_d.view().data);
  EXPECT_THROW(segment_attention_plan::build({rows, ids_d.view().data, true, 0}, partial),
               invalid_input);
}

TEST(GpuSegmentAttention, BadArgumentsAreNamed) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> ids = random_ids(4, 13);
  const auto rows = static_cast<std::int64_t>(ids.size());
  host_tensor ids_h(dtype::f64, rows, 1, 1);
  std::memcpy(ids_h.data(), ids.data(), ids.size() * 8);
  test::device_tensor ids_d(ids_h);
  EXPECT_THROW(segment_attention_plan::build({-1, ids_d.view().data, true, 0}), invalid_input);
  EXPECT_THROW(segment_attention_plan::build({rows, nullptr, true, 0}), invalid_input);
  const auto plan = segment_attention_plan::build({rows, ids_d.view().data, true, 0});
  test::device_tensor q(host_tensor(dtype::bf16, rows, 2, 64)),
      short_k(host_tensor(dtype::bf16, rows - 1, 2, 64)),
      odd(host_tensor(dtype::bf16, rows, 2, 48)), f32(host_tensor(dtype::f32, rows, 2, 64)),
      ws(host_tensor(dtype::f32, static_cast<std::int64_t>(plan.workspace_bytes()), 1, 1));
  const workspace_view w{ws.view().data, plan.workspace_bytes()};
  EXPECT_THROW(plan.run(q.view(), short_k.view(), q.view(), q.view(), {}, w), invalid_input);
  EXPECT_THROW(plan.run(odd.view(), odd.view(), odd.view(), odd.view(), {}, w), not_supported);
  EXPECT_THROW(plan.run(f32.view(), f32.view(), f32.view(), f32.view(), {}, w), not_supported);
  EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), q.view(), {}, {ws.view().data, 8}),
               invalid_input);
  // Dropout: p in [0, 1), and a generator state to draw from.
  const auto* state = static_cast<const std::uint64_t*>(ws.view().data);
  EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), q.view(), {.dropout = {1.0, state}}, w),
               invalid_input);
  EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), q.view(), {.dropout = {0.2, nullptr}}, w),
               invalid_input);
  // The pair bias: f32 [rows, H or 1, M]; its gradient [rows, H, M] in backward() only.
  test::device_tensor bias(host_tensor(dtype::f32, rows, 2, 8)),
      bias3(host_tensor(dtype::f32, rows, 3, 8)), bias16(host_tensor(dtype::bf16, rows, 2, 8)),
      short_bias(host_tensor(dtype::f32, rows - 1, 2, 8));
  for (test::device_tensor* b : {&bias3, &bias16, &short_bias})
    EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), q.view(), {.bias = b->view()}, w),
                 invalid_input);
  EXPECT_THROW(plan.run(q.view(), q.view(), q.view(), q.view(),
                        {.bias = bias.view(), .dbias = bias.view()}, w),
               invalid_input);
}

}  // namespace
}  // namespace trisparse
