// One test over every op x backend x (input, output) dtype x shape the library offers, against
// the float64 reference (llama.cpp's test-backend-ops is the model). Shapes: the head dims, widths,
// block sizes, product orders and head layouts each op takes, on small patterns with empty rows and
// a hub. The per-kernel test files vary what is particular to a kernel (patterns, row orders, work
// cuts, datasets) and take the dtype pairs in turn. Each op registers a function that, for a
// device, runs its cases through the public API and hands each result to the recorder; a backend
// that does not take a dtype says so by throwing not_supported, and the recorder lists it as not
// offered. The test prints what it covered. Built twice: op_tests (the CPU backends, label unit)
// and op_gpu_tests (the CUDA backends, label gpu; skipped without a device). A new op or backend
// is tested by adding a registration here.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "support.hpp"

#ifndef TRISPARSE_OP_TEST_DEVICE
#define TRISPARSE_OP_TEST_DEVICE cpu
#endif

namespace trisparse {
namespace {

constexpr device_kind kWhere = device_kind::TRISPARSE_OP_TEST_DEVICE;

// A tensor on the device under test: inputs copied there, outputs poisoned (NaN) first.
class buffer {
 public:
  buffer(const host_tensor& h) : host_(h) {  // NOLINT(google-explicit-constructor)
    if (kWhere == device_kind::cuda) dev_.emplace(host_);
  }
  static buffer output(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
    host_tensor h(t, rows, heads, dim);
    h.fill(std::numeric_limits<double>::quiet_NaN());
    return buffer(h);
  }
  // A [slots, H, 1] output in the sparse plans' slot layout (the slots of each head in a run).
  static buffer slot_output(dtype t, std::int64_t slots, std::int64_t heads) {
    buffer b = output(t, std::max<std::int64_t>(slots, 1) * heads, 1, 1);
    b.slots_ = slots;
    b.slot_heads_ = heads;
    return b;
  }
  tensor_view view() {
    tensor_view v = dev_ ? dev_->view() : host_.view();
    if (slot_heads_ > 0) {
      v.rows = slots_;
      v.heads = slot_heads_;
      v.row_stride = 1;
      v.head_stride = std::max<std::int64_t>(slots_, 1);
    }
    return v;
  }
  host_tensor fetch() const { return dev_ ? dev_->to_host() : host_; }

 private:
  host_tensor host_;
  std::optional<device_tensor> dev_;
  std::int64_t slots_ = 0, slot_heads_ = 0;
};

host_tensor random(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim,
                   std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  host_tensor h(t, rows, heads, dim);
  h.fill_uniform(lo, hi, seed);
  return h;
}

host_tensor as_f64(const host_tensor& h) {
  host_tensor out(dtype::f64, h.rows(), h.heads(), h.dim());
  for (std::int64_t i = 0; i < h.numel(); ++i) out.set(i, h.get(i));
  return out;
}

constexpr dtype kDtypes[] = {dtype::f16, dtype::bf16, dtype::f32, dtype::f64};

// The output dtype a case asks for by default: f32 for 16-bit inputs, else the input's.
dtype out_of(dtype in) { return in == dtype::f16 || in == dtype::bf16 ? dtype::f32 : in; }

// A case's input and output dtypes, named "f16" when the output is the default (out_of), else
// "f16->f16".
struct types {
  dtype in, out;
  std::string name() const {
    return std::string(to_string(in)) +
           (out == out_of(in) ? "" : "->" + std::string(to_string(out)));
  }
};

// Every (input, output) pair the ops offer: each input with its default output, and 16-bit
// inputs written in their own dtype too.
std::vector<types> type_pairs() {
  std::vector<types> out;
  for (const dtype in : kDtypes) {
    out.push_back({in, out_of(in)});
    if (out_of(in) != in) out.push_back({in, in});
  }
  return out;
}

// Normwise tolerance: `units` roundings of the input (f32 on CUDA: tf32's 11 bits) and of the
// output, plus 1e-5 (1e-12 for float64 through and through: every CPU engine computes float64
// inputs in float64).
double tolerance(dtype in, dtype out, double units = 4) {
  const double u_in =
      kWhere == device_kind::cuda && in == dtype::f32 ? std::ldexp(1.0, -11) : unit_roundoff(in);
  const double floor = in == dtype::f64 && out == dtype::f64 ? 1e-12 : 1e-5;
  return units * (u_in + unit_roundoff(out)) + floor;
}

// What the cases ran: per (op, backend) the dtypes checked, those not offered, and the shapes.
class recorder {
 public:
  // `what`: which output of the case, for the failure's trace (one shape, several outputs).
  void check(const std::string& op, const std::string& backend, types t, const std::string& shape,
             const host_tensor& got, const host_tensor& want, double tol,
             const std::string& what = "") {
    SCOPED_TRACE(op + " / " + backend + " / " + t.name() + " / " + shape + " " + what);
    const auto e = test::compare(got, want);
    EXPECT_TRUE(e.finite) << "unwritten or non-finite outputs";
    EXPECT_LE(e.relative(), tol) << "max abs " << e.max_abs;
    covered_[{op, backend}].insert(t.name());
    shapes_[{op, backend}].insert(shape);
    ++cases_;
  }
  // Runs one case; a not_supported from the library marks (op, backend, types) as not offered,
  // any other library error fails the case and the next case runs.
  void attempt(const std::string& op, const std::string& backend, types t,
               const std::function<void()>& f) {
    try {
      f();
    } catch (const not_supported&) {
      absent_[{op, backend}].insert(t.name());
    } catch (const error& e) {
      ADD_FAILURE() << op << " / " << backend << " / " << t.name() << ": " << e.what();
    }
  }
  std::size_t cases() const { return cases_; }
  std::set<std::string> ops() const {
    std::set<std::string> out;
    for (const auto& [key, _] : covered_) out.insert(key.first);
    return out;
  }
  void print() const {
    std::printf("[ covered ] %zu cases on %s\n", cases_, std::string(to_string(kWhere)).c_str());
    for (const auto& [key, dtypes] : covered_) {
      std::string line;
      for (const auto& d : dtypes) line += " " + d;
      std::string absent;
      if (const auto it = absent_.find(key); it != absent_.end())
        for (const auto& d : it->second) absent += " " + d;
      std::printf("[ covered ] %-24s %-22s%s%s; %zu shapes\n", key.first.c_str(),
                  key.second.c_str(), line.c_str(),
                  absent.empty() ? "" : ("  (not offered:" + absent + ")").c_str(),
                  shapes_.at(key).size());
    }
  }

 private:
  std::map<std::pair<std::string, std::string>, std::set<std::string>> covered_, absent_, shapes_;
  std::size_t cases_ = 0;
};

// Patterns: rectangular with empty rows, and one row (a hub) that attends to every column.
struct shape {
  std::string name;
  csr_graph pattern;
};
std::vector<shape> shapes() {
  csr_graph hub = test::random_pattern(70, 90, 6, 3);
  csr_graph with_hub;
  with_hub.rows = hub.rows;
  with_hub.cols = hub.cols;
  with_hub.row_ptr = {0};
  for (std::int64_t c = 0; c < hub.cols; ++c)
    with_hub.col_idx.push_back(static_cast<std::int32_t>(c));
  with_hub.row_ptr.push_back(with_hub.nnz());
  for (std::int64_t r = 1; r < hub.rows; ++r) {
    for (std::int64_t e = hub.row_ptr[r]; e < hub.row_ptr[r + 1]; ++e)
      with_hub.col_idx.push_back(hub.col_idx[e]);
    with_hub.row_ptr.push_back(with_hub.nnz());
  }
  return {{"70x90 random, empty rows", test::random_pattern(70, 90, 5, 1)},
          {"70x90 with a 90-entry row", with_hub}};
}

// --- attention: forward per algorithm, backward -----------------------------------------------

void attention_cases(recorder& rec) {
  for (const auto& s : shapes()) {
    const csr_graph& g = s.pattern;
    for (const algorithm a : {algorithm::blocked_reference, algorithm::fused, algorithm::unfused}) {
      if (!runs_on(a, kWhere)) continue;
      const std::string backend = backend_name(a, kWhere);
      for (const std::int64_t dim : {32, 64, 128, 256}) {
        const std::string shape = s.name + ", d " + std::to_string(dim);
        for (const types t : type_pairs()) {
          rec.attempt("attention", backend, t, [&] {
            const auto plan = attention_plan::build(g, kWhere, {.algo = a, .gradients = true});
            const std::int64_t heads = 2;
            const host_tensor q = random(t.in, g.rows, heads, dim, 10 + dim),
                              k = random(t.in, g.cols, heads, dim, 11 + dim),
                              v = random(t.in, g.cols, heads, dim, 12 + dim);
            buffer bq(q), bk(k), bv(v), out = buffer::output(t.out, g.rows, heads, dim);
            plan.run(bq.view(), bk.view(), bv.view(), out.view());
            host_tensor want(dtype::f64, g.rows, heads, dim);
            reference::attention(g, q.view(), k.view(), v.view(), want.view(),
                                 effective_scale({}, dim));
            rec.check("attention", backend, t, shape, out.fetch(), want, tolerance(t.in, t.out, 4));
          });
        }
      }
    }
    // The backward from the forward's output and lse; gradients in the default output dtype.
    for (const algorithm a : {algorithm::fused}) {
      if (!runs_on(a, kWhere)) continue;
      const std::string backend = backend_name(a, kWhere);
      for (const std::int64_t dim : {32, 64, 128}) {
        const std::string shape = s.name + ", d " + std::to_string(dim);
        for (const dtype in : kDtypes) {
          const types t{in, out_of(in)};
          rec.attempt("attention_backward", backend, t, [&] {
            const auto plan = attention_plan::build(g, kWhere, {.algo = a, .gradients = true});
            const std::int64_t heads = 2;
            const host_tensor q = random(in, g.rows, heads, dim, 20 + dim),
                              k = random(in, g.cols, heads, dim, 21 + dim),
                              v = random(in, g.cols, heads, dim, 22 + dim),
                              dout = random(in, g.rows, heads, dim, 23 + dim);
            buffer bq(q), bk(k), bv(v), bdout(dout),
                out = buffer::output(in, g.rows, heads, dim),
                // float64's lse on the CPU (which computes float64 in float64), else f32.
                lse = buffer::output(
                    in == dtype::f64 && kWhere == device_kind::cpu ? dtype::f64 : dtype::f32,
                    g.rows, heads, 1);
            buffer dq = buffer::output(t.out, g.rows, heads, dim),
                   dk = buffer::output(t.out, g.cols, heads, dim),
                   dv = buffer::output(t.out, g.cols, heads, dim);
            plan.run(bq.view(), bk.view(), bv.view(), out.view(), {.lse = lse.view()});
            plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                          dq.view(), dk.view(), dv.view());
            host_tensor wq(dtype::f64, g.rows, heads, dim), wk(dtype::f64, g.cols, heads, dim),
                wv(dtype::f64, g.cols, heads, dim);
            reference::attention_backward(g, q.view(), k.view(), v.view(), dout.view(), wq.view(),
                                          wk.view(), wv.view(), effective_scale({}, dim));
            // The forward's output is rounded to q's dtype before the backward reads it.
            const double tol =
                tolerance(in, t.out, 8) + (in == dtype::f64 ? 0 : unit_roundoff(in) * 8);
            rec.check("attention_backward", backend, t, shape, dq.fetch(), wq, tol, "dq");
            rec.check("attention_backward", backend, t, shape, dk.fetch(), wk, tol, "dk");
            rec.check("attention_backward", backend, t, shape, dv.fetch(), wv, tol, "dv");
          });
        }
      }
    }
  }
}

// --- SpMM, SDDMM, softmax (sparse_plan) -------------------------------------------------------

void sparse_cases(recorder& rec) {
  for (const auto& s : shapes()) {
    csr_graph g = s.pattern;
    g.values.resize(static_cast<std::size_t>(g.nnz()));
    for (std::int64_t e = 0; e < g.nnz(); ++e)
      g.values[e] = 0.5f + 0.01f * static_cast<float>(e % 37);
    const std::string backend = kWhere == device_kind::cuda ? "cuda_me_bcrs" : "cpu_sparse";
    const std::int64_t heads = 2;
    // Widths: odd (unaligned rows), one tile and a tail, past four tiles.
    for (const std::int64_t dim : {5, 24, 130}) {
      const std::string shape = s.name + ", n " + std::to_string(dim);
      for (const types t : type_pairs()) {
        for (const bool per_head : {false, true}) {
          rec.attempt("spmm", backend, t, [&] {
            const auto plan = sparse_plan::build(g, kWhere);
            const host_tensor b = random(t.in, g.cols, heads, dim, 30 + dim),
                              w = random(t.in, g.nnz(), heads, 1, 34 + dim, 0.25, 1.0);
            buffer bb(b), bw(w), c = buffer::output(t.out, g.rows, heads, dim),
                                 slots = buffer::slot_output(t.in, plan.slots(), heads);
            if (per_head) plan.to_slots(bw.view(), slots.view());
            plan.spmm(per_head ? slots.view() : tensor_view{}, bb.view(), c.view());
            host_tensor want(dtype::f64, g.rows, heads, dim);
            reference::spmm(g, per_head ? w.view() : tensor_view{}, b.view(), want.view());
            rec.check("spmm", backend, t, shape + (per_head ? ", values per head" : ""), c.fetch(),
                      want, tolerance(t.in, t.out));
          });
        }
      }
    }
    for (const std::int64_t dim : {8, 24, 100}) {
      const std::string shape = s.name + ", d " + std::to_string(dim);
      for (const types t : type_pairs()) {
        rec.attempt("sddmm", backend, t, [&] {
          const auto plan = sparse_plan::build(g, kWhere);
          const host_tensor x = random(t.in, g.rows, heads, dim, 31 + dim),
                            y = random(t.in, g.cols, heads, dim, 32 + dim);
          buffer bx(x), by(y), slots = buffer::slot_output(t.out, plan.slots(), heads),
                               entries = buffer::output(t.out, g.nnz(), heads, 1);
          plan.sddmm(bx.view(), by.view(), slots.view(), 0.5);
          plan.to_entries(slots.view(), entries.view());
          host_tensor want(dtype::f64, g.nnz(), heads, 1);
          reference::sddmm(g, x.view(), y.view(), want.view(), 0.5);
          rec.check("sddmm", backend, t, shape, entries.fetch(), want, tolerance(t.in, t.out, 16));
        });
      }
    }
    for (const dtype in : kDtypes) {
      const types t{in, in};
      rec.attempt("softmax", backend, t, [&] {
        const auto plan = sparse_plan::build(g, kWhere);
        const host_tensor scores = random(in, g.nnz(), heads, 1, 33, -4.0, 4.0);
        buffer be(scores), slots = buffer::slot_output(in, plan.slots(), heads),
                           probs = buffer::slot_output(in, plan.slots(), heads),
                           entries = buffer::output(in, g.nnz(), heads, 1);
        plan.to_slots(be.view(), slots.view());
        plan.softmax(slots.view(), probs.view());
        plan.to_entries(probs.view(), entries.view());
        host_tensor want(dtype::f64, g.nnz(), heads, 1);
        reference::softmax(g, scores.view(), want.view());
        rec.check("softmax", backend, t, s.name, entries.fetch(), want, tolerance(in, in));
      });
    }
  }
}

// --- block-sparse attention: forward per algorithm, backward ----------------------------------

void block_sparse_cases(recorder& rec) {
  const std::vector<std::int64_t> lens{70, 0, 33, 130};
  for (const std::int64_t g : {16, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                .block = g,
                                                .p = 0.4,
                                                .causal = causal,
                                                .heads = 2,
                                                .seed = 5},
                                               lens);
      const std::string shape = "G" + std::to_string(g) + (causal ? " causal" : "") + " ragged";
      const std::int64_t rows = mask.cu_seqlens_q.back(), heads = 2;
      for (const algorithm a : {algorithm::fused, algorithm::block, algorithm::unfused}) {
        if (!runs_on(a, kWhere)) continue;
        const std::string backend = backend_name(a, kWhere, true);
        for (const std::int64_t dim : {64, 128}) {
          const std::string at = shape + ", d " + std::to_string(dim);
          for (const types t : type_pairs()) {
            const dtype in = t.in;
            rec.attempt("block_sparse_attention", backend, t, [&] {
              const auto plan = block_sparse_attention_plan::build(
                  mask, kWhere, {.algo = a, .gradients = a == algorithm::block});
              const host_tensor q = random(in, rows, heads, dim, 40),
                                k = random(in, rows, heads, dim, 41),
                                v = random(in, rows, heads, dim, 42),
                                dout = random(in, rows, heads, dim, 43);
              buffer bq(q), bk(k), bv(v), out = buffer::output(t.out, rows, heads, dim);
              plan.run(bq.view(), bk.view(), bv.view(), out.view());
              host_tensor want(dtype::f64, rows, heads, dim);
              reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), want.view(),
                                                effective_scale({}, dim));
              rec.check("block_sparse_attention", backend, t, at, out.fetch(), want,
                        tolerance(in, t.out, 4));
              // The backward where the backend has one (gradients in the default dtype).
              if (kWhere == device_kind::cuda && a != algorithm::block) return;
              if (t.out != out_of(in)) return;
              buffer o16 = buffer::output(in, rows, heads, dim),
                     lse = buffer::output(dtype::f32, rows, heads, 1), bdout(dout);
              const bool with_lse = a == algorithm::block;
              plan.run(bq.view(), bk.view(), bv.view(), o16.view(),
                       {.lse = with_lse ? lse.view() : tensor_view{}});
              const dtype grad = out_of(in);
              buffer dq = buffer::output(grad, rows, heads, dim),
                     dk = buffer::output(grad, rows, heads, dim),
                     dv = buffer::output(grad, rows, heads, dim);
              plan.backward(bq.view(), bk.view(), bv.view(), o16.view(),
                            with_lse ? lse.view() : tensor_view{}, bdout.view(), dq.view(),
                            dk.view(), dv.view());
              host_tensor wq(dtype::f64, rows, heads, dim), wk(dtype::f64, rows, heads, dim),
                  wv(dtype::f64, rows, heads, dim);
              reference::block_sparse_attention_backward(mask, q.view(), k.view(), v.view(),
                                                         dout.view(), wq.view(), wk.view(),
                                                         wv.view(), effective_scale({}, dim));
              const double tol =
                  tolerance(in, grad, 8) + (in == dtype::f64 ? 0 : unit_roundoff(in) * 8);
              rec.check("block_sparse_backward", backend, t, at, dq.fetch(), wq, tol, "dq");
              rec.check("block_sparse_backward", backend, t, at, dk.fetch(), wk, tol, "dk");
              rec.check("block_sparse_backward", backend, t, at, dv.fetch(), wv, tol, "dv");
            });
          }
        }
      }
    }
  }
}

// --- the GCN layer: out = Â (x w) ---------------------------------------------------------------

void gcn_cases(recorder& rec) {
  const csr_graph g = test::random_pattern(80, 80, 6, 7);
  const csr_graph a_hat = gcn_normalized(g);
  const std::string backend = kWhere == device_kind::cuda ? "cuda_me_bcrs" : "cpu_layers";
  // Widths that take x w first, Â x first, and odd ones.
  for (const auto& [f_in, f_out] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{24, 40}, {128, 64}, {32, 96}, {5, 3}}) {
    const std::string shape =
        "80x80, self loops, " + std::to_string(f_in) + "->" + std::to_string(f_out);
    for (const types t : type_pairs()) {
      rec.attempt("gcn_layer", backend, t, [&] {
        const auto layer = gcn_layer::build(g, kWhere);
        const host_tensor x = random(t.in, g.rows, 1, f_in, 50 + f_in),
                          w = random(t.in, f_in, 1, f_out, 51 + f_out);
        buffer bx(x), bw(w), out = buffer::output(t.out, g.rows, 1, f_out);
        layer.forward(bx.view(), bw.view(), out.view());
        // x w in float64, then Â (x w).
        const host_tensor x64 = as_f64(x), w64 = as_f64(w);
        host_tensor xw(dtype::f64, g.rows, 1, f_out), want(dtype::f64, g.rows, 1, f_out);
        for (std::int64_t i = 0; i < g.rows; ++i)
          for (std::int64_t j = 0; j < f_out; ++j) {
            double acc = 0;
            for (std::int64_t e = 0; e < f_in; ++e)
              acc += x64.get(i * f_in + e) * w64.get(e * f_out + j);
            xw.set(i * f_out + j, acc);
          }
        reference::spmm(a_hat, tensor_view{}, xw.view(), want.view());
        rec.check("gcn_layer", backend, t, shape, out.fetch(), want, tolerance(t.in, t.out, 16));
      });
    }
  }
}

// --- the fused GCN layer: relu(P x w + bias) -------------------------------------------------

void gcn_fused_cases(recorder& rec) {
  const csr_graph p = gcn_normalized(test::random_pattern(80, 80, 6, 8));
  const std::string backend = kWhere == device_kind::cuda ? "cuda_gcn_fused" : "cpu_layers";
  const std::int64_t f_in = 24, f_out = 40;
  for (const auto& [order, name] :
       std::vector<std::pair<gcn_order, std::string>>{{gcn_order::automatic, "automatic"},
                                                      {gcn_order::fused, "fused"},
                                                      {gcn_order::unfused, "unfused"}}) {
    const std::string shape = "80x80 with bias, ReLU, " + name + " order";
    for (const types t : type_pairs()) {
      rec.attempt("gcn_fused_layer", backend, t, [&] {
        const auto plan = gcn_fused_plan::build(p, kWhere);
        const host_tensor x = random(t.in, p.rows, 1, f_in, 60),
                          w = random(t.in, f_in, 1, f_out, 61),
                          bias = random(dtype::f32, 1, 1, f_out, 62);
        const std::size_t bytes = plan.workspace_bytes(f_in, f_out, t.in, order);
        buffer bx(x), bw(w), bb(bias),
            out = buffer::output(t.out, p.rows, 1, f_out),
            workspace = buffer::output(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1);
        plan.forward(
            {.x = bx.view(), .w = bw.view(), .bias = bb.view(), .out = out.view(), .order = order},
            {}, {workspace.view().data, bytes});
        host_tensor want(dtype::f64, p.rows, 1, f_out);
        reference::gcn_fused(p, x.view(), w.view(), bias.view(), true, want.view());
        rec.check("gcn_fused_layer", backend, t, shape, out.fetch(), want,
                  tolerance(t.in, t.out, 16));
      });
    }
  }
}

// --- GAT's attention: forward and backward -----------------------------------------------------

void gat_cases(recorder& rec) {
  for (const auto& s : shapes()) {
    const csr_graph& g = s.pattern;
    const std::string backend = kWhere == device_kind::cuda ? "cuda_gat" : "cpu_layers";
    for (const auto& [heads, width] :
         std::vector<std::pair<std::int64_t, std::int64_t>>{{2, 16}, {3, 5}, {1, 64}}) {
      const std::string shape =
          s.name + ", " + std::to_string(heads) + " x " + std::to_string(width);
      for (const types t : type_pairs()) {
        const dtype in = t.in;
        rec.attempt("gat_attention", backend, t, [&] {
          const auto plan = gat_plan::build(g, kWhere);
          const host_tensor x = random(in, g.cols, heads, width, 70),
                            a_src = random(dtype::f32, g.cols, heads, 1, 71, -2.0, 2.0),
                            a_dst = random(dtype::f32, g.rows, heads, 1, 72, -2.0, 2.0),
                            dout = random(t.out, g.rows, heads, width, 73);
          buffer bx(x), bs(a_src), bd(a_dst), bdout(dout),
              out = buffer::output(t.out, g.rows, heads, width),
              lse = buffer::output(dtype::f32, g.rows, heads, 1);
          plan.forward({.x = bx.view(),
                        .a_src = bs.view(),
                        .a_dst = bd.view(),
                        .out = out.view(),
                        .lse = lse.view()});
          host_tensor want(dtype::f64, g.rows, heads, width);
          reference::gat(g, x.view(), a_src.view(), a_dst.view(), tensor_view{}, 0.2, want.view(),
                         tensor_view{});
          rec.check("gat_attention", backend, t, shape, out.fetch(), want, tolerance(in, t.out));
          buffer dx = buffer::output(t.out, g.cols, heads, width),
                 da_src = buffer::output(dtype::f32, g.cols, heads, 1),
                 da_dst = buffer::output(dtype::f32, g.rows, heads, 1);
          const std::size_t bytes = plan.backward_workspace_bytes(heads, width);
          buffer workspace =
              buffer::output(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1);
          plan.backward({.x = bx.view(),
                         .a_src = bs.view(),
                         .a_dst = bd.view(),
                         .out = out.view(),
                         .lse = lse.view(),
                         .dout = bdout.view(),
                         .dx = dx.view(),
                         .da_src = da_src.view(),
                         .da_dst = da_dst.view()},
                        {}, {workspace.view().data, bytes});
          host_tensor wx(dtype::f64, g.cols, heads, width), ws(dtype::f64, g.cols, heads, 1),
              wd(dtype::f64, g.rows, heads, 1);
          reference::gat_backward(g, x.view(), a_src.view(), a_dst.view(), tensor_view{}, 0.2,
                                  dout.view(), wx.view(), ws.view(), wd.view());
          // The backward reads the forward's lse (f32); float64 recomputes it in float64. The
          // score gradients are written in f32.
          // out (rounded to its dtype) enters the backward through D = <dout, out>.
          const double tol = tolerance(in, t.out, 8) + 4 * unit_roundoff(t.out),
                       tol_a = tolerance(in, dtype::f32, 8) + 4 * unit_roundoff(t.out);
          rec.check("gat_backward", backend, t, shape, dx.fetch(), wx, tol, "dx");
          rec.check("gat_backward", backend, t, shape, da_src.fetch(), ws, tol_a, "da_src");
          rec.check("gat_backward", backend, t, shape, da_dst.fetch(), wd, tol_a, "da_dst");
        });
      }
    }
  }
}

// --- the AGNN layer: out_i = sum_j softmax_j(beta cos(h_i, h_j)) h_j over row i of A + I --------

void agnn_cases(recorder& rec) {
  const csr_graph g = test::random_pattern(80, 80, 6, 9);
  csr_graph with_loops = gcn_normalized(g);  // A + I's pattern
  with_loops.values.clear();
  const std::string backend = kWhere == device_kind::cuda ? "cuda_me_bcrs" : "cpu_layers";
  for (const auto& [f, beta] : std::vector<std::pair<std::int64_t, double>>{{24, 1.5}, {100, -3}}) {
    const std::string shape = "80x80, self loops, a zero row, f " + std::to_string(f);
    for (const types t : type_pairs()) {
      rec.attempt("agnn_layer", backend, t, [&] {
        const auto layer = agnn_layer::build(g, kWhere);
        host_tensor h = random(t.in, g.rows, 1, f, 80 + f);
        for (std::int64_t x = 0; x < f; ++x) h.set(5 * f + x, 0.0);  // a zero row: cosine 0
        buffer bh(h), out = buffer::output(t.out, g.rows, 1, f);
        layer.forward(bh.view(), beta, out.view());
        // The float64 attention with q = k = h's rows normalised, v = h, scale beta.
        host_tensor unit = as_f64(h);
        for (std::int64_t i = 0; i < g.rows; ++i) {
          double norm = 0;
          for (std::int64_t x = 0; x < f; ++x) norm += unit.get(i * f + x) * unit.get(i * f + x);
          for (std::int64_t x = 0; x < f; ++x)
            unit.set(i * f + x, norm > 0 ? unit.get(i * f + x) / std::sqrt(norm) : 0.0);
        }
        host_tensor want(dtype::f64, g.rows, 1, f);
        reference::attention(with_loops, unit.view(), unit.view(), h.view(), want.view(), beta);
        rec.check("agnn_layer", backend, t, shape, out.fetch(), want, tolerance(t.in, t.out, 16));
      });
    }
  }
}

// --- attention within segments (CUDA; the CPU takes the segments' pattern as attention) -------

void segment_cases(recorder& rec) {
  if (kWhere != device_kind::cuda) return;
  // Segments of 1 - 70 rows (one past a tile), ids with a gap, and their block-diagonal pattern.
  std::vector<std::int64_t> ids;
  std::int64_t id = 0;
  for (const std::int64_t size : {1, 5, 70, 3, 30}) {
    ids.insert(ids.end(), static_cast<std::size_t>(size), id);
    id += size == 5 ? 2 : 1;
  }
  const auto rows = static_cast<std::int64_t>(ids.size());
  coo_graph coo;
  coo.rows = coo.cols = rows;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < rows; ++j)
      if (ids[static_cast<std::size_t>(i)] == ids[static_cast<std::size_t>(j)]) {
        coo.src.push_back(i);
        coo.dst.push_back(j);
      }
  const csr_graph g = to_csr(coo);
  host_tensor ids_h(dtype::f64, rows, 1, 1);  // the int64 ids' bytes
  std::memcpy(ids_h.data(), ids.data(), ids.size() * sizeof(std::int64_t));
  buffer bids(ids_h);
  const std::string backend = "cuda_segments";
  for (const std::int64_t dim : {16, 32, 64, 128}) {
    const std::string shape = "5 segments, d " + std::to_string(dim);
    for (const dtype in : kDtypes) {
      const types t{in, in};
      rec.attempt("segment_attention", backend, t, [&] {
        const auto plan = segment_attention_plan::build({rows, bids.view().data, true, 0});
        const std::int64_t heads = 2;
        const host_tensor q = random(in, rows, heads, dim, 90),
                          k = random(in, rows, heads, dim, 91),
                          v = random(in, rows, heads, dim, 92),
                          dout = random(in, rows, heads, dim, 93);
        buffer bq(q), bk(k), bv(v), bdout(dout),
            out = buffer::output(in, rows, heads, dim),
            lse = buffer::output(dtype::f32, rows, heads, 1),
            dq = buffer::output(dtype::f32, rows, heads, dim),
            dk = buffer::output(dtype::f32, rows, heads, dim),
            dv = buffer::output(dtype::f32, rows, heads, dim),
            ws = buffer::output(
                dtype::f32, static_cast<std::int64_t>(plan.backward_workspace_bytes(heads) / 4 + 1),
                1, 1);
        const workspace_view w{ws.view().data, plan.backward_workspace_bytes(heads)};
        plan.run(bq.view(), bk.view(), bv.view(), out.view(), {.lse = lse.view()}, w);
        plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                      dq.view(), dk.view(), dv.view(), {}, w);
        const double scale = effective_scale({}, dim);
        host_tensor want(dtype::f64, rows, heads, dim), wq(dtype::f64, rows, heads, dim),
            wk(dtype::f64, rows, heads, dim), wv(dtype::f64, rows, heads, dim);
        reference::attention(g, q.view(), k.view(), v.view(), want.view(), scale);
        reference::attention_backward(g, q.view(), k.view(), v.view(), dout.view(), wq.view(),
                                      wk.view(), wv.view(), scale);
        rec.check("segment_attention", backend, t, shape, out.fetch(), want, tolerance(in, in, 4));
        const double tol = tolerance(in, dtype::f32, 8) + unit_roundoff(in) * 8;
        rec.check("segment_attention", backend, t, shape, dq.fetch(), wq, tol, "dq");
        rec.check("segment_attention", backend, t, shape, dk.fetch(), wk, tol, "dk");
        rec.check("segment_attention", backend, t, shape, dv.fetch(), wv, tol, "dv");
      });
    }
  }
}

// Every op's registration: add one here for a new op.
const std::vector<std::function<void(recorder&)>>& registry() {
  static const std::vector<std::function<void(recorder&)>> all{
      attention_cases, sparse_cases, block_sparse_cases, gcn_cases,
      gcn_fused_cases, agnn_cases,   gat_cases,          segment_cases};
  return all;
}

TEST(EveryOp, AgainstTheFloat64Reference) {
  if (kWhere == device_kind::cuda && !cuda_available())
    GTEST_SKIP() << "no CUDA device visible: skipping";
  recorder rec;
  for (const auto& cases : registry()) cases(rec);
  rec.print();
  // Every registered op ran somewhere on this device.
  for (const char* op : {"attention", "attention_backward", "spmm", "sddmm", "softmax",
                         "block_sparse_attention", "block_sparse_backward", "gcn_layer",
                         "gcn_fused_layer", "agnn_layer", "gat_attention", "gat_backward"})
    EXPECT_TRUE(rec.ops().count(op)) << op << ": no case ran on " << to_string(kWhere);
  if (kWhere == device_kind::cuda) {
    EXPECT_TRUE(rec.ops().count("segment_attention")) << "segment_attention: no case ran";
  }
}

}  // namespace
}  // namespace trisparse
