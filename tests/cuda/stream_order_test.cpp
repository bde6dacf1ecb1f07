// Every GPU plan's run is stream-ordered (label gpu; skipped without a device): captured in a CUDA
// graph in global capture mode (which rejects a device synchronisation or cudaMalloc anywhere in
// the process during capture) and replayed, it gives the float64 reference result and the eager
// run's bits; two input sets run concurrently on two streams, each with its own workspace, give
// the same bits as one at a time.
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "device_tensor.hpp"

namespace trisparse {
namespace {

using test::cuda_check;

// One GPU run of one plan on input set 0 or 1, with its float64 reference.
struct gpu_case {
  std::string name;
  std::size_t workspace_bytes = 0;
  double tolerance = 0;
  // Writes set `set`'s output on `s`, with the caller's workspace (or the plan's own: nullptr).
  std::function<void(int set, const workspace_view* ws, cudaStream_t s)> run;
  std::function<host_tensor(int set)> reference;
  std::function<test::device_tensor&(int set)> out;
};

// Device memory that the test owns (workspaces), freed at scope exit.
struct device_memory {
  explicit device_memory(std::size_t n) : bytes(n) {
    cuda_check(cudaMalloc(&data, std::max<std::size_t>(n, 256)), "cudaMalloc");
  }
  ~device_memory() { cudaFree(data); }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  workspace_view view() const { return {data, bytes}; }
  void* data = nullptr;
  std::size_t bytes = 0;
};

struct stream {
  stream() { cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"); }
  ~stream() { cudaStreamDestroy(s); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  cudaStream_t s = nullptr;
};

host_tensor eager(const gpu_case& c, int set, const workspace_view* ws) {
  c.out(set).poison();
  c.run(set, ws, nullptr);
  return c.out(set).download();
}

void expect_same_bits(const host_tensor& a, const host_tensor& b, const char* what) {
  ASSERT_EQ(a.size_bytes(), b.size_bytes());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size_bytes()), 0) << what;
}

// Captures the run in a graph (global mode), replays it twice with the output poisoned before
// each, and checks: the reference within tolerance, and the eager run's bits.
void check_graph(const gpu_case& c, const workspace_view* ws) {
  const host_tensor want = eager(c, 0, ws);
  const auto e = test::compare(want, c.reference(0));
  ASSERT_TRUE(e.finite) << "unwritten or non-finite outputs";
  EXPECT_LE(e.relative(), c.tolerance) << "max abs " << e.max_abs;
  stream st;
  cudaGraph_t graph = nullptr;
  cuda_check(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), "begin capture");
  try {
    c.run(0, ws, st.s);
  } catch (...) {
    cudaStreamEndCapture(st.s, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  cuda_check(cudaStreamEndCapture(st.s, &graph), "end capture (the run is not stream-ordered)");
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int replay = 0; replay < 2; ++replay) {
    c.out(0).poison();
    cuda_check(cudaGraphLaunch(exec, st.s), "graph launch");
    cuda_check(cudaStreamSynchronize(st.s), "graph replay");
    expect_same_bits(c.out(0).download(), want, "graph replay differs from the eager run");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Runs (a, set_a) on one stream and (b, set_b) on another, four times each, interleaved so that
// they overlap, and checks both outputs against the bits they had run alone.
void overlap(const gpu_case& a, int set_a, const workspace_view& wa, const host_tensor& want_a,
             const gpu_case& b, int set_b, const workspace_view& wb, const host_tensor& want_b) {
  stream sa, sb;
  a.out(set_a).poison();
  b.out(set_b).poison();
  for (int i = 0; i < 4; ++i) {  // neither stream waits for the other
    a.run(set_a, &wa, sa.s);
    b.run(set_b, &wb, sb.s);
  }
  cuda_check(cudaStreamSynchronize(sa.s), "stream a");
  cuda_check(cudaStreamSynchronize(sb.s), "stream b");
  expect_same_bits(a.out(set_a).download(), want_a, "the first run beside the second");
  expect_same_bits(b.out(set_b).download(), want_b, "the second run beside the first");
}

// Both input sets on two streams at once, each with its own workspace, several times over.
void check_two_streams(const gpu_case& c) {
  device_memory ws0(c.workspace_bytes), ws1(c.workspace_bytes);
  const workspace_view w0 = ws0.view(), w1 = ws1.view();
  const host_tensor want0 = eager(c, 0, &w0), want1 = eager(c, 1, &w1);
  const auto e = test::compare(want1, c.reference(1));
  EXPECT_LE(e.relative(), c.tolerance) << "set 1, max abs " << e.max_abs;
  for (int round = 0; round < 3; ++round)
    ASSERT_NO_FATAL_FAILURE(overlap(c, 0, w0, want0, c, 1, w1, want1));
}

// A graph whose hub row (every column) makes the fused kernel split windows and run teams, and
// whose SpMM splits windows: the runs' workspaces are used, not only sized.
csr_graph hub_graph(std::int64_t n, std::uint64_t seed) {
  csr_graph g = test::random_pattern(n, n, 12, seed);
  coo_graph coo{.rows = n, .cols = n, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      coo.src.push_back(r);
      coo.dst.push_back(g.col_idx[e]);
    }
  for (std::int64_t c = 0; c < n; ++c) {
    coo.src.push_back(5);
    coo.dst.push_back(c);
  }
  return to_csr(coo);
}

// Inputs, outputs and references of the cases below: two sets of random tensors.
struct io {
  std::vector<host_tensor> host;                           // per set: the inputs
  std::vector<std::unique_ptr<test::device_tensor>> dev;   // per set: the inputs on the device
  std::vector<std::unique_ptr<test::device_tensor>> outs;  // per set: the output
  test::device_tensor& in(int set, int i, int per_set) { return *dev[set * per_set + i]; }
};

std::shared_ptr<io> make_io(const std::vector<std::array<std::int64_t, 3>>& shapes, dtype in,
                            const std::array<std::int64_t, 3>& out_shape, dtype out,
                            std::uint64_t seed) {
  auto x = std::make_shared<io>();
  for (int set = 0; set < 2; ++set) {
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      host_tensor h(in, shapes[i][0], shapes[i][1], shapes[i][2]);
      h.fill_uniform(-1.0, 1.0, seed + 10 * set + i);
      x->dev.push_back(std::make_unique<test::device_tensor>(h));
      x->host.push_back(std::move(h));
    }
    x->outs.push_back(std::make_unique<test::device_tensor>(
        host_tensor(out, out_shape[0], out_shape[1], out_shape[2])));
  }
  return x;
}

// A case for a plan whose run() takes q, k, v and out (attention, block-sparse): `reference`
// writes the float64 result of one input set's q, k, v into out.
template <class Plan, class Reference>
gpu_case qkv_case(std::string name, std::shared_ptr<const Plan> plan, std::shared_ptr<io> x,
                  std::int64_t heads, std::int64_t dim, dtype in, Reference reference) {
  return gpu_case{.name = std::move(name),
                  .workspace_bytes = plan->workspace_bytes(heads, dim),
                  .tolerance = test::gpu_tolerance(in, dtype::f32, 4),
                  .run =
                      [plan, x](int set, const workspace_view* ws, cudaStream_t s) {
                        plan->run(x->in(set, 0, 3).view(), x->in(set, 1, 3).view(),
                                  x->in(set, 2, 3).view(), x->outs[set]->view(), {}, {s},
                                  ws != nullptr ? *ws : workspace_view{});
                      },
                  .reference =
                      [x, reference](int set) {
                        const tensor_view o = x->outs[set]->view();
                        host_tensor ref(dtype::f64, o.rows, o.heads, o.dim);
                        reference(x->host[set * 3].view(), x->host[set * 3 + 1].view(),
                                  x->host[set * 3 + 2].view(), ref.view());
                        return ref;
                      },
                  .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }};
}

std::vector<gpu_case> attention_cases() {
  std::vector<gpu_case> cases;
  const csr_graph g = hub_graph(3000, 11);
  const std::int64_t heads = 2, dim = 64;
  for (const algorithm a : {algorithm::fused, algorithm::unfused}) {
    const auto plan =
        std::make_shared<attention_plan>(attention_plan::build(g, device_kind::cuda, {.algo = a}));
    auto x = make_io({{g.rows, heads, dim}, {g.cols, heads, dim}, {g.cols, heads, dim}}, dtype::f16,
                     {g.rows, heads, dim}, dtype::f32, 21);
    cases.push_back(qkv_case("attention " + std::string(to_string(a)),
                             std::shared_ptr<const attention_plan>(plan), x, heads, dim, dtype::f16,
                             [g, dim](const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out) {
                               reference::attention(g, q, k, v, out, effective_scale({}, dim));
                             }));
  }
  return cases;
}

// The attention backward (dq, dk, dv; dk is the output checked), its log-sum-exp recomputed.
std::vector<gpu_case> backward_cases() {
  const csr_graph g = hub_graph(3000, 12);
  const std::int64_t heads = 2, dim = 64;
  const double scale = effective_scale({}, dim);
  const auto plan = std::make_shared<const attention_plan>(
      attention_plan::build(g, device_kind::cuda, {.gradients = true}));
  // Per set: q, k, v, dout; the output is dk.
  auto x = make_io(
      {{g.rows, heads, dim}, {g.cols, heads, dim}, {g.cols, heads, dim}, {g.rows, heads, dim}},
      dtype::f16, {g.cols, heads, dim}, dtype::f32, 31);
  struct scratch {
    std::vector<std::unique_ptr<test::device_tensor>> out, dq, dv;  // per set
  };
  auto e = std::make_shared<scratch>();
  for (int set = 0; set < 2; ++set) {
    // out in dout's dtype (f16), as the backward requires.
    host_tensor out64(dtype::f64, g.rows, heads, dim), out(dtype::f16, g.rows, heads, dim);
    reference::attention(g, x->host[set * 4].view(), x->host[set * 4 + 1].view(),
                         x->host[set * 4 + 2].view(), out64.view(), scale);
    for (std::int64_t i = 0; i < out.numel(); ++i) out.set(i, out64.get(i));
    e->out.push_back(std::make_unique<test::device_tensor>(out));
    e->dq.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f32, g.rows, heads, dim)));
    e->dv.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f32, g.cols, heads, dim)));
  }
  gpu_case c{.name = "attention backward",
             .workspace_bytes = plan->backward_workspace_bytes(heads, dim),
             .tolerance = test::gpu_tolerance(dtype::f16, dtype::f32, 8),
             .run =
                 [plan, x, e](int set, const workspace_view* ws, cudaStream_t s) {
                   plan->backward(x->in(set, 0, 4).view(), x->in(set, 1, 4).view(),
                                  x->in(set, 2, 4).view(), e->out[set]->view(), {},
                                  x->in(set, 3, 4).view(), e->dq[set]->view(), x->outs[set]->view(),
                                  e->dv[set]->view(), {}, {s},
                                  ws != nullptr ? *ws : workspace_view{});
                 },
             .reference =
                 [x, g, scale](int set) {
                   const auto& h = x->host;
                   host_tensor dq(dtype::f64, g.rows, h[0].heads(), h[0].dim()),
                       dk(dtype::f64, g.cols, h[0].heads(), h[0].dim()),
                       dv(dtype::f64, g.cols, h[0].heads(), h[0].dim());
                   reference::attention_backward(g, h[set * 4].view(), h[set * 4 + 1].view(),
                                                 h[set * 4 + 2].view(), h[set * 4 + 3].view(),
                                                 dq.view(), dk.view(), dv.view(), scale);
                   return dk;
                 },
             .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }};
  return {c};
}

std::vector<gpu_case> sparse_cases() {
  std::vector<gpu_case> cases;
  const csr_graph g = hub_graph(3000, 12);
  const std::int64_t heads = 2, n = 48;  // n not a multiple of 16: the masked last chunk
  const auto plan =
      std::make_shared<sparse_plan>(sparse_plan::build(g, device_kind::cuda, {.split_blocks = 4}));
  const std::int64_t slots = plan->slots();
  const double tol = test::gpu_tolerance(dtype::f16, dtype::f32, 4);
  // SpMM with per-head values in the slot layout (from random per-edge values).
  {
    auto x = make_io({{g.cols, heads, n}}, dtype::f16, {g.rows, heads, n}, dtype::f32, 31);
    auto w = std::make_shared<std::vector<host_tensor>>();
    auto wslots = std::make_shared<std::vector<std::unique_ptr<test::device_tensor>>>();
    for (int set = 0; set < 2; ++set) {
      host_tensor e(dtype::f16, g.nnz(), heads, 1);
      e.fill_uniform(0.0, 1.0, 41 + set);
      test::device_tensor de(e);
      host_tensor sl(dtype::f16, slots, heads, 1);
      wslots->push_back(std::make_unique<test::device_tensor>(sl));
      tensor_view to = wslots->back()->view();
      to.row_stride = 1;
      to.head_stride = slots;
      plan->to_slots(de.view(), to);
      cuda_check(cudaDeviceSynchronize(), "to_slots");
      w->push_back(std::move(e));
    }
    const auto slot_view = [wslots, slots](int set) {
      tensor_view v = (*wslots)[set]->view();
      v.row_stride = 1;
      v.head_stride = slots;
      return v;
    };
    cases.push_back(
        gpu_case{.name = "sparse spmm",
                 .workspace_bytes = plan->workspace_bytes(heads, n),
                 .tolerance = tol,
                 .run =
                     [plan, x, slot_view](int set, const workspace_view* ws, cudaStream_t s) {
                       plan->spmm(slot_view(set), x->in(set, 0, 1).view(), x->outs[set]->view(),
                                  {s}, ws != nullptr ? *ws : workspace_view{});
                     },
                 .reference =
                     [g, x, w, n](int set) {
                       host_tensor ref(dtype::f64, g.rows, 2, n);
                       reference::spmm(g, (*w)[set].view(), x->host[set].view(), ref.view());
                       return ref;
                     },
                 .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }});
  }
  // SDDMM -> softmax into the slot layout, then back to CSR entry order (a chain on one stream).
  {
    auto x = make_io({{g.rows, heads, n}, {g.cols, heads, n}}, dtype::f16, {g.nnz(), heads, 1},
                     dtype::f32, 51);
    auto scratch = std::make_shared<std::vector<std::unique_ptr<test::device_tensor>>>();
    for (int set = 0; set < 2; ++set)
      scratch->push_back(
          std::make_unique<test::device_tensor>(host_tensor(dtype::f32, slots, heads, 1)));
    cases.push_back(gpu_case{
        .name = "sparse sddmm+softmax",
        .workspace_bytes = plan->workspace_bytes(heads, 1),
        .tolerance = tol,
        .run =
            [plan, x, scratch, slots](int set, const workspace_view* ws, cudaStream_t s) {
              tensor_view sc = (*scratch)[set]->view();
              sc.row_stride = 1;
              sc.head_stride = slots;
              plan->sddmm(x->in(set, 0, 2).view(), x->in(set, 1, 2).view(), sc, 0.125, {s});
              plan->softmax(sc, sc, {s}, ws != nullptr ? *ws : workspace_view{});
              plan->to_entries(sc, x->outs[set]->view(), {s});
            },
        .reference =
            [g, x](int set) {
              host_tensor sc(dtype::f64, g.nnz(), 2, 1), ref(dtype::f64, g.nnz(), 2, 1);
              reference::sddmm(g, x->host[set * 2].view(), x->host[set * 2 + 1].view(), sc.view(),
                               0.125);
              reference::softmax(g, sc.view(), ref.view());
              return ref;
            },
        .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }});
  }
  return cases;
}

std::vector<gpu_case> block_sparse_cases() {
  std::vector<gpu_case> cases;
  const std::vector<std::int64_t> lens{1000, 333};
  const std::int64_t heads = 2, dim = 64, rows = 1333;
  struct variant {
    algorithm algo;
    std::int64_t block, mask_heads;
  };
  for (const variant vt : {variant{algorithm::block, 64, 2}, variant{algorithm::fused, 16, 2},
                           variant{algorithm::unfused, 32, 1}}) {
    const block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::random,
                                                           .block = vt.block,
                                                           .p = 0.7,
                                                           .causal = true,
                                                           .heads = vt.mask_heads,
                                                           .seed = 3},
                                                          lens);
    const auto plan = std::make_shared<block_sparse_attention_plan>(
        block_sparse_attention_plan::build(mask, device_kind::cuda, {.algo = vt.algo}));
    auto x = make_io({{rows, heads, dim}, {rows, heads, dim}, {rows, heads, dim}}, dtype::bf16,
                     {rows, heads, dim}, dtype::f32, 61);
    cases.push_back(qkv_case(
        "block-sparse " + std::string(to_string(vt.algo)),
        std::shared_ptr<const block_sparse_attention_plan>(plan), x, heads, dim, dtype::bf16,
        [mask, dim](const tensor_view& q, const tensor_view& k, const tensor_view& v,
                    const tensor_view& out) {
          reference::block_sparse_attention(mask, q, k, v, out, effective_scale({}, dim));
        }));
  }
  return cases;
}

// The block-sparse backward (dq, dk, dv; dk is the output checked) from the GPU forward's out and
// lse, on a ragged batch with per-head causal masks.
std::vector<gpu_case> block_sparse_backward_cases() {
  const std::vector<std::int64_t> lens{1000, 333};
  const std::int64_t heads = 2, dim = 64, rows = 1333;
  const double scale = effective_scale({}, dim);
  const block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::random,
                                                         .block = 64,
                                                         .p = 0.7,
                                                         .causal = true,
                                                         .heads = 2,
                                                         .seed = 5},
                                                        lens);
  const auto plan = std::make_shared<const block_sparse_attention_plan>(
      block_sparse_attention_plan::build(mask, device_kind::cuda, {.gradients = true}));
  // Per set: q, k, v, dout; the output is dk.
  auto x = make_io({{rows, heads, dim}, {rows, heads, dim}, {rows, heads, dim}, {rows, heads, dim}},
                   dtype::f16, {rows, heads, dim}, dtype::f32, 91);
  struct scratch {
    std::vector<std::unique_ptr<test::device_tensor>> out, lse, dq, dv;  // per set
  };
  auto e = std::make_shared<scratch>();
  for (int set = 0; set < 2; ++set) {
    e->out.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f16, rows, heads, dim)));
    e->lse.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f32, rows, heads, 1)));
    e->dq.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f32, rows, heads, dim)));
    e->dv.push_back(
        std::make_unique<test::device_tensor>(host_tensor(dtype::f32, rows, heads, dim)));
    plan->run(x->in(set, 0, 4).view(), x->in(set, 1, 4).view(), x->in(set, 2, 4).view(),
              e->out[set]->view(), {.lse = e->lse[set]->view()});
  }
  cuda_check(cudaDeviceSynchronize(), "block-sparse forward");
  gpu_case c{.name = "block-sparse backward",
             .workspace_bytes = plan->backward_workspace_bytes(heads),
             .tolerance = test::gpu_tolerance(dtype::f16, dtype::f32, 8),
             .run =
                 [plan, x, e](int set, const workspace_view* ws, cudaStream_t s) {
                   plan->backward(x->in(set, 0, 4).view(), x->in(set, 1, 4).view(),
                                  x->in(set, 2, 4).view(), e->out[set]->view(), e->lse[set]->view(),
                                  x->in(set, 3, 4).view(), e->dq[set]->view(), x->outs[set]->view(),
                                  e->dv[set]->view(), {}, {s},
                                  ws != nullptr ? *ws : workspace_view{});
                 },
             .reference =
                 [x, mask, scale, rows](int set) {
                   const auto& h = x->host;
                   host_tensor dq(dtype::f64, rows, 2, 64), dk(dtype::f64, rows, 2, 64),
                       dv(dtype::f64, rows, 2, 64);
                   reference::block_sparse_attention_backward(
                       mask, h[set * 4].view(), h[set * 4 + 1].view(), h[set * 4 + 2].view(),
                       h[set * 4 + 3].view(), dq.view(), dk.view(), dv.view(), scale);
                   return dk;
                 },
             .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }};
  return {c};
}

std::vector<gpu_case> layer_cases() {
  std::vector<gpu_case> cases;
  const csr_graph g = hub_graph(2000, 13);
  const std::int64_t in = 40, out = 24;
  const double tol = test::gpu_tolerance(dtype::f16, dtype::f32, 8);
  {
    const auto layer = std::make_shared<gcn_layer>(gcn_layer::build(g, device_kind::cuda));
    auto x = make_io({{g.rows, 1, in}, {in, 1, out}}, dtype::f16, {g.rows, 1, out}, dtype::f32, 71);
    cases.push_back(gpu_case{
        .name = "gcn layer",
        .workspace_bytes = layer->workspace_bytes(in, out),
        .tolerance = tol,
        .run =
            [layer, x](int set, const workspace_view* ws, cudaStream_t s) {
              layer->forward(x->in(set, 0, 2).view(), x->in(set, 1, 2).view(), x->outs[set]->view(),
                             {s}, ws != nullptr ? *ws : workspace_view{});
            },
        .reference =
            [g, x, out](int set) {
              host_tensor ref(dtype::f64, g.rows, 1, out);
              gcn_layer::build(g).forward(x->host[set * 2].view(), x->host[set * 2 + 1].view(),
                                          ref.view());
              return ref;
            },
        .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }});
  }
  {
    const auto layer = std::make_shared<agnn_layer>(agnn_layer::build(g, device_kind::cuda));
    auto x = make_io({{g.rows, 1, in}}, dtype::f16, {g.rows, 1, in}, dtype::f32, 81);
    cases.push_back(
        gpu_case{.name = "agnn layer",
                 .workspace_bytes = layer->workspace_bytes(in),
                 .tolerance = tol,
                 .run =
                     [layer, x](int set, const workspace_view* ws, cudaStream_t s) {
                       layer->forward(x->in(set, 0, 1).view(), 1.5, x->outs[set]->view(), {s},
                                      ws != nullptr ? *ws : workspace_view{});
                     },
                 .reference =
                     [g, x, in](int set) {
                       host_tensor ref(dtype::f64, g.rows, 1, in);
                       agnn_layer::build(g).forward(x->host[set].view(), 1.5, ref.view());
                       return ref;
                     },
                 .out = [x](int set) -> test::device_tensor& { return *x->outs[set]; }});
  }
  return cases;
}

// Every GPU plan, in one list (the registry the two tests below walk).
std::vector<gpu_case> all_cases() {
  std::vector<gpu_case> all;
  for (auto&& part : {attention_cases(), backward_cases(), sparse_cases(), block_sparse_cases(),
                      block_sparse_backward_cases(), layer_cases()})
    for (const gpu_case& c : part) all.push_back(c);
  return all;
}

TEST(GpuStreamOrder, EveryPlansRunReplaysFromACudaGraph) {
  SKIP_WITHOUT_GPU();
  for (const gpu_case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    ASSERT_GT(c.workspace_bytes + 1, 0u);
    device_memory ws(c.workspace_bytes);
    const workspace_view w = ws.view();
    ASSERT_NO_FATAL_FAILURE(check_graph(c, &w));       // the caller's workspace
    ASSERT_NO_FATAL_FAILURE(check_graph(c, nullptr));  // the plan's own
  }
}

TEST(GpuStreamOrder, TwoStreamsRunPlansConcurrentlyWithTheirOwnWorkspaces) {
  SKIP_WITHOUT_GPU();
  for (const gpu_case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    ASSERT_NO_FATAL_FAILURE(check_two_streams(c));
  }
}

// Two different plans at once: the fused attention and the block-sparse kernel, one stream each.
TEST(GpuStreamOrder, DifferentPlansOverlapOnTwoStreams) {
  SKIP_WITHOUT_GPU();
  const auto a = attention_cases().front();
  const auto b = block_sparse_cases().front();
  device_memory wa(a.workspace_bytes), wb(b.workspace_bytes);
  const workspace_view va = wa.view(), vb = wb.view();
  const host_tensor want_a = eager(a, 0, &va), want_b = eager(b, 0, &vb);
  overlap(a, 0, va, want_a, b, 0, vb, want_b);
}

// The top-k plan selects into its own mask: select and run captured together replay the eager
// pair's bits.
TEST(GpuStreamOrder, TopkSelectAndRunReplayFromACudaGraph) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int64_t> cu{0, 1024, 1600};
  const std::int64_t heads = 2, dim = 64;
  auto plan = topk_block_sparse_plan::build(cu, cu, heads, dim, {.block = 64, .top_k = 3});
  auto x = make_io({{1600, heads, dim}, {1600, heads, dim}, {1600, heads, dim}}, dtype::f16,
                   {1600, heads, dim}, dtype::f32, 91);
  const auto run = [&](cudaStream_t s) {
    plan.select(x->in(0, 0, 3).view(), x->in(0, 1, 3).view(), {s});
    plan.run(x->in(0, 0, 3).view(), x->in(0, 1, 3).view(), x->in(0, 2, 3).view(),
             x->outs[0]->view(), {}, {s});
  };
  x->outs[0]->poison();
  run(nullptr);
  const host_tensor want = x->outs[0]->download();
  host_tensor ref(dtype::f64, 1600, heads, dim);
  const block_sparse_mask mask =
      topk_block_mask(x->host[0].view(), x->host[1].view(), cu, cu, {.block = 64, .top_k = 3});
  reference::block_sparse_attention(mask, x->host[0].view(), x->host[1].view(), x->host[2].view(),
                                    ref.view(), effective_scale({}, dim));
  EXPECT_LE(test::compare(want, ref).relative(), test::gpu_tolerance(dtype::f16, dtype::f32, 4));
  stream st;
  cudaGraph_t graph = nullptr;
  cuda_check(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), "begin capture");
  run(st.s);
  cuda_check(cudaStreamEndCapture(st.s, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  x->outs[0]->poison();
  cuda_check(cudaGraphLaunch(exec, st.s), "graph launch");
  cuda_check(cudaStreamSynchronize(st.s), "graph replay");
  expect_same_bits(x->outs[0]->download(), want, "top-k graph replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// A run whose workspace is too small says so, naming the size it needs.
TEST(GpuStreamOrder, TooSmallAWorkspaceIsRejected) {
  SKIP_WITHOUT_GPU();
  const gpu_case c = attention_cases().front();
  ASSERT_GT(c.workspace_bytes, 256u);
  device_memory ws(c.workspace_bytes);
  const workspace_view small{ws.data, c.workspace_bytes - 256};
  EXPECT_THROW(c.run(0, &small, nullptr), invalid_input);
  const workspace_view misaligned{static_cast<char*>(ws.data) + 8, c.workspace_bytes - 256};
  EXPECT_THROW(c.run(0, &misaligned, nullptr), invalid_input);
  // A plan without split windows needs only its task queue: its own workspace serves any heads.
  const csr_graph g = test::random_pattern(300, 300, 6, 9);
  const attention_plan plan = attention_plan::build(g, device_kind::cuda);
  ASSERT_EQ(plan.workspace_bytes(12, 64), plan.workspace_bytes(1, 64));
  const auto x = test::random_qkv(g, 12, 64, dtype::f16, 10);
  test::device_tensor q(x.q), k(x.k), v(x.v), out(host_tensor(dtype::f32, g.rows, 12, 64));
  EXPECT_NO_THROW(plan.run(q.view(), k.view(), v.view(), out.view()));
}

}  // namespace
}  // namespace trisparse
