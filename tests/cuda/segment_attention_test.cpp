// Attention within segments on CUDA (label gpu; skipped without a device): forward (out, lse) and
// backward (dq, dk, dv) against the float64 reference over the segments' block-diagonal pattern,
// for f16 and bf16, head dims 16 - 128, int32 and int64 ids; segments of one row, empty ids
// (gaps), segments longer than a tile, rows not a multiple of the tile; outputs and workspaces
// poisoned, bitwise repeatable; bad arguments named.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
