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
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "bias_problem.hpp"
#include "support.hpp"
#include "topk_rows.hpp"

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
  // Poisoned scratch memory of at least `bytes` bytes (a plan's workspace).
  static buffer scratch(std::size_t bytes) {
    return output(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1);
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

// --- the attention score bias (attention_options::bias, dbias): forward and backward ----------

void attention_bias_cases(recorder& rec) {
  for (const auto& s : shapes()) {
    const csr_graph& g = s.pattern;
    for (const algorithm a : {algorithm::fused}) {
      if (!runs_on(a, kWhere)) continue;
      const std::string backend = backend_name(a, kWhere);
      for (const std::int64_t dim : {16, 64, 128}) {
        for (const bool shared : {false, true}) {
          const std::string shape = s.name + ", d " + std::to_string(dim) +
                                    (shared ? ", shared bias" : ", bias per head");
          for (const dtype in : kDtypes) {
            const types t{in, out_of(in)};
            rec.attempt("attention_bias", backend, t, [&] {
              const std::int64_t heads = 2;
              const double scale = effective_scale({}, dim);
              const test::biased_problem p =
                  test::make_biased_problem(g, heads, dim, in, shared, scale, 200 + dim);
              const auto plan = attention_plan::build(g, kWhere, {.algo = a, .gradients = true});
              const dtype lse_type =
                  in == dtype::f64 && kWhere == device_kind::cpu ? dtype::f64 : dtype::f32;
              buffer bq(p.q), bk(p.k), bv(p.v), bbias(p.bias), bdout(p.dout),
                  out = buffer::output(t.out, g.rows, heads, dim),
                  lse = buffer::output(lse_type, g.rows, heads, 1),
                  dq = buffer::output(t.out, g.rows, heads, dim),
                  dk = buffer::output(t.out, g.cols, heads, dim),
                  dv = buffer::output(t.out, g.cols, heads, dim),
                  dbias = buffer::output(lse_type, g.nnz(), heads, 1);
              plan.run(bq.view(), bk.view(), bv.view(), out.view(),
                       {.scale = scale, .lse = lse.view(), .bias = bbias.view()});
              rec.check("attention_bias", backend, t, shape, out.fetch(), p.out,
                        tolerance(in, t.out, 8), "out");
              const auto [lse_got, lse_want] = test::finite_lse(lse.fetch(), p.lse);
              rec.check("attention_bias", backend, t, shape, lse_got, lse_want,
                        tolerance(in, lse_type, 8), "lse");
              plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                            dq.view(), dk.view(), dv.view(),
                            {.scale = scale, .bias = bbias.view(), .dbias = dbias.view()});
              const double tol =
                  tolerance(in, t.out, 16) + (in == dtype::f64 ? 0 : 8 * unit_roundoff(in));
              rec.check("attention_bias", backend, t, shape, dq.fetch(), p.dq, tol, "dq");
              rec.check("attention_bias", backend, t, shape, dk.fetch(), p.dk, tol, "dk");
              rec.check("attention_bias", backend, t, shape, dv.fetch(), p.dv, tol, "dv");
              rec.check("attention_bias", backend, t, shape, dbias.fetch(), p.dbias, tol, "dbias");
            });
          }
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

// --- attention dropout in the CUDA block kernels: the float64 multigraph reference over the
// mask's (query, key) pairs, each with the factor the draw gives ------------------------------

// The pairs a mask with one mask head allows: in packed rows (edge p: target src[p], source
// dst[p]), and their sequence and rows within it (what the dropout draws are counted by).
struct mask_pairs {
  coo_graph coo;
  std::vector<std::int64_t> seq, i, j;
};

mask_pairs pairs_of(const block_sparse_mask& mask) {
  mask_pairs out;
  coo_graph& coo = out.coo;
  coo.rows = mask.cu_seqlens_q.back();
  coo.cols = mask.cu_seqlens_k.back();
  const std::int64_t g = mask.block;
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    const std::int64_t q0 = mask.cu_seqlens_q[static_cast<std::size_t>(b)],
                       k0 = mask.cu_seqlens_k[static_cast<std::size_t>(b)], lq = mask.len_q(b),
                       lk = mask.len_k(b);
    const csr_graph& blocks = mask.masks[static_cast<std::size_t>(b)].blocks;
    for (std::int64_t r = 0; r < blocks.rows; ++r)
      for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e)
        for (std::int64_t i = r * g; i < std::min(lq, (r + 1) * g); ++i)
          for (std::int64_t j = blocks.col_idx[e] * g;
               j < std::min(lk, (blocks.col_idx[e] + 1) * g); ++j)
            if (!mask.causal || j <= i + lk - lq) {
              coo.src.push_back(q0 + i);
              coo.dst.push_back(k0 + j);
              out.seq.push_back(b);
              out.i.push_back(i);
              out.j.push_back(j);
            }
  }
  return out;
}

// A random block mask over sequences of `lens` for the cases with per-block tensors (importance,
// bias: [batch * QB, H, KB], QB = KB the longest sequence's blocks) and the backend with a
// backward (the CPU engine, CUDA's block kernels).
struct blocked_case {
  block_sparse_mask mask;
  std::int64_t rows, qb, kb, block_rows;
  algorithm algo;
  std::string backend;
};

blocked_case make_blocked_case(const std::vector<std::int64_t>& lens, block_layout_options o) {
  o.layout = block_layout::random;
  blocked_case c;
  c.mask = make_block_sparse_mask(o, lens);
  c.rows = c.mask.cu_seqlens_q.back();
  c.qb = c.kb = (*std::max_element(lens.begin(), lens.end()) + o.block - 1) / o.block;
  c.block_rows = static_cast<std::int64_t>(lens.size()) * c.qb;
  c.algo = kWhere == device_kind::cuda ? algorithm::block : algorithm::fused;
  c.backend = backend_name(c.algo, kWhere, true);
  return c;
}

// Attention dropout drawn in the kernels, alone and with a per-head block bias (the dropout
// kernels read it where set): out, dq, dk, dv and dblock_bias against the float64 reference over
// the expanded pairs with the same draws (the bias as a feature term: r one-hot per head, a the
// pair's bias per head, so that da is dS per head).
// Attention dropout's generator state {seed, offset} where the plans run (the device for CUDA).
buffer dropout_state(std::uint64_t seed, std::uint64_t offset) {
  host_tensor state(dtype::f64, 2, 1, 1);  // (two 8-byte words)
  std::memcpy(state.data(), &seed, sizeof seed);
  std::memcpy(reinterpret_cast<char*>(state.data()) + sizeof seed, &offset, sizeof offset);
  return buffer(state);
}

void block_sparse_dropout_cases(recorder& rec) {
  const bool cuda = kWhere == device_kind::cuda;
  // The backends that draw it: CUDA's block kernels, the CPU engine (the state in host memory).
  const algorithm algo = cuda ? algorithm::block : algorithm::fused;
  const std::string backend = backend_name(algo, kWhere, true);
  // (300: dB has a scale to be compared at, as block_sparse_bias_cases says.)
  const std::vector<std::int64_t> lens{70, 0, 33, 300};
  const std::uint64_t seed = 0x0123456789ABCDEFull, offset = 5;
  buffer bstate = dropout_state(seed, offset);
  const attention_dropout drop{0.25, static_cast<const std::uint64_t*>(bstate.view().data)};
  const std::int64_t heads = 2;
  // G 16: mma.sync plans; 64 and 128 on sm_90: wgmma plans (their own 64-row tiles; the
  // two-warpgroup plan's 128-row tiles give way to the backward's).
  for (const std::int64_t g : {16, 64, 128}) {
    for (const bool causal : {false, true}) {
      const blocked_case c =
          make_blocked_case(lens, {.block = g, .p = 0.6, .causal = causal, .seed = 8});
      const block_sparse_mask& mask = c.mask;
      const mask_pairs all = pairs_of(mask);
      const coo_graph& pairs = all.coo;
      const auto e = static_cast<std::int64_t>(pairs.src.size());
      const std::int64_t rows = c.rows, qb = c.qb, kb = c.kb, bias_rows = c.block_rows;
      host_tensor keep(dtype::f64, e, heads, 1);
      // The bias of pair p's block in bias_rows x heads x kb.
      std::vector<std::int64_t> bias_at(static_cast<std::size_t>(e));
      for (std::size_t p = 0; p < all.seq.size(); ++p) {
        bias_at[p] = (all.seq[p] * qb + all.i[p] / g) * heads * kb + all.j[p] / g;
        for (std::int32_t h = 0; h < heads; ++h)
          keep.set(static_cast<std::int64_t>(p) * heads + h,
                   dropout_factor(drop, seed, offset, all.i[p], all.j[p],
                                  static_cast<std::int32_t>(all.seq[p] * heads + h)));
      }
      host_tensor one_hot(dtype::f64, rows, heads, heads);
      one_hot.fill(0.0);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t h = 0; h < heads; ++h) one_hot.set((r * heads + h) * heads + h, 1.0);
      for (const block_kernel kernel : {block_kernel::automatic, block_kernel::wgmma_pingpong}) {
        if (kernel == block_kernel::wgmma_pingpong && (g % 128 != 0 || !cuda)) continue;
        for (const bool biased : {false, true}) {
          const std::string shape =
              "G" + std::to_string(g) + (causal ? " causal" : "") + " ragged, dropout" +
              (biased ? ", block bias" : "") +
              (kernel == block_kernel::wgmma_pingpong ? ", pingpong plan" : "");
          for (const std::int64_t dim : {64, 128}) {
            if (biased && dim == 128 && !cuda) continue;  // (the CPU engine's loops take any D)
            const std::string at = shape + ", d " + std::to_string(dim);
            for (const dtype in : kDtypes) {
              const types t{in, in};
              rec.attempt("block_sparse_dropout", backend, t, [&] {
                const dtype grad = cuda ? in : out_of(in);
                const auto plan = block_sparse_attention_plan::build(
                    mask, kWhere, {.algo = algo, .kernel = kernel, .gradients = cuda});
                const host_tensor q = random(in, rows, heads, dim, 50),
                                  k = random(in, rows, heads, dim, 51),
                                  v = random(in, rows, heads, dim, 52),
                                  dout = random(in, rows, heads, dim, 53);
                const dtype bias_type = in == dtype::f64 && !cuda ? dtype::f64 : dtype::f32;
                host_tensor bias = random(bias_type, bias_rows, heads, kb, 54);
                host_tensor zeros(bias_type, bias_rows, heads, kb);
                zeros.fill(0.0);
                buffer bq(q), bk(k), bv(v), bdout(dout), bbias(bias), dbias(zeros),
                    out = buffer::output(in, rows, heads, dim),
                    lse = buffer::output(dtype::f32, rows, heads, 1),
                    dq = buffer::output(grad, rows, heads, dim),
                    dk = buffer::output(grad, rows, heads, dim),
                    dv = buffer::output(grad, rows, heads, dim);
                // The lse on CUDA only (the CPU backward recomputes it).
                const tensor_view lse_view = cuda ? lse.view() : tensor_view{};
                const tensor_view bias_view = biased ? bbias.view() : tensor_view{},
                                  dbias_view = biased ? dbias.view() : tensor_view{};
                const std::size_t bytes = plan.backward_workspace_bytes(heads, biased);
                buffer ws = buffer::scratch(bytes);
                plan.run(bq.view(), bk.view(), bv.view(), out.view(),
                         {.lse = lse_view, .block_bias = bias_view, .dropout = drop});
                plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse_view, bdout.view(),
                              dq.view(), dk.view(), dv.view(),
                              {.block_bias = bias_view, .dblock_bias = dbias_view, .dropout = drop},
                              {}, {bytes > 0 ? ws.view().data : nullptr, bytes});
                const double scale = effective_scale({}, dim);
                host_tensor want(dtype::f64, rows, heads, dim), wq(dtype::f64, rows, heads, dim),
                    wk(dtype::f64, rows, heads, dim), wv(dtype::f64, rows, heads, dim),
                    a(dtype::f64, e, 1, heads), da(dtype::f64, e, 1, heads),
                    dr(dtype::f64, rows, heads, heads);
                for (std::int64_t p = 0; p < e; ++p)
                  for (std::int64_t h = 0; h < heads; ++h)
                    a.set(p * heads + h, bias.get(bias_at[static_cast<std::size_t>(p)] + h * kb));
                const tensor_view r_view = biased ? one_hot.view() : tensor_view{},
                                  a_view = biased ? a.view() : tensor_view{};
                reference::edge_attention(pairs, q.view(), k.view(), v.view(), r_view, a_view,
                                          keep.view(), scale, want.view(), {}, {});
                reference::edge_attention_backward(
                    pairs, q.view(), k.view(), v.view(), r_view, a_view, keep.view(), scale,
                    dout.view(), {}, wq.view(), wk.view(), wv.view(),
                    biased ? dr.view() : tensor_view{}, biased ? da.view() : tensor_view{});
                rec.check("block_sparse_dropout", backend, t, at, out.fetch(), want,
                          tolerance(in, in, 4), "out");
                const double tol = tolerance(in, in, 8) + unit_roundoff(in) * 8;
                rec.check("block_sparse_dropout", backend, t, at, dq.fetch(), wq, tol, "dq");
                rec.check("block_sparse_dropout", backend, t, at, dk.fetch(), wk, tol, "dk");
                rec.check("block_sparse_dropout", backend, t, at, dv.fetch(), wv, tol, "dv");
                if (!biased) return;
                host_tensor wb(dtype::f64, bias_rows, heads, kb);
                wb.fill(0.0);
                for (std::int64_t p = 0; p < e; ++p) {
                  for (std::int64_t h = 0; h < heads; ++h) {
                    const std::int64_t x = bias_at[static_cast<std::size_t>(p)] + h * kb;
                    wb.set(x, wb.get(x) + da.get(p * heads + h));
                  }
                }
                rec.check("block_sparse_dropout", backend, t, at, dbias.fetch(), wb, tol,
                          "dblock_bias");
              });
            }
          }
        }
      }
    }
  }
}

// --- block importance (attention_options::block_mass, block_grad) and top-k masks -------------

void block_importance_cases(recorder& rec) {
  const std::vector<std::int64_t> lens{70, 0, 33, 130};
  const std::int64_t heads = 2, dim = 64;
  for (const std::int64_t g : {16, 64}) {
    for (const bool causal : {false, true}) {
      const blocked_case c = make_blocked_case(
          lens, {.block = g, .p = 0.5, .causal = causal, .heads = heads, .seed = 6});
      const block_sparse_mask& mask = c.mask;
      const std::string shape = "G" + std::to_string(g) + (causal ? " causal" : "") + " ragged";
      const std::int64_t rows = c.rows, kb = c.kb, importance_rows = c.block_rows;
      const algorithm a = c.algo;
      const std::string& backend = c.backend;
      for (const dtype in : kDtypes) {
        const types t{in, dtype::f32};
        rec.attempt("block_importance", backend, t, [&] {
          const auto plan = block_sparse_attention_plan::build(
              mask, kWhere, {.algo = a, .gradients = kWhere == device_kind::cuda});
          const double scale = effective_scale({}, dim);
          const host_tensor q = random(in, rows, heads, dim, 45),
                            k = random(in, rows, heads, dim, 46),
                            v = random(in, rows, heads, dim, 47),
                            dout = random(in, rows, heads, dim, 48);
          buffer bq(q), bk(k), bv(v), bdout(dout),
              out = buffer::output(in, rows, heads, dim),
              lse = buffer::output(dtype::f32, rows, heads, 1),
              dq = buffer::output(out_of(in), rows, heads, dim),
              dk = buffer::output(out_of(in), rows, heads, dim),
              dv = buffer::output(out_of(in), rows, heads, dim),
              mass = buffer::output(dtype::f32, importance_rows, heads, kb),
              grad = buffer::output(dtype::f32, importance_rows, heads, kb);
          const std::size_t bytes = plan.backward_workspace_bytes(heads, true);
          buffer ws = buffer::scratch(bytes);
          // The CPU's backward recomputes the forward (out and lse unused).
          const tensor_view lse_view = kWhere == device_kind::cuda ? lse.view() : tensor_view{};
          plan.run(bq.view(), bk.view(), bv.view(), out.view(), {.lse = lse_view});
          plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse_view, bdout.view(),
                        dq.view(), dk.view(), dv.view(),
                        {.block_mass = mass.view(), .block_grad = grad.view()}, {},
                        {bytes > 0 ? ws.view().data : nullptr, bytes});
          host_tensor want[2] = {host_tensor(dtype::f64, importance_rows, heads, kb),
                                 host_tensor(dtype::f64, importance_rows, heads, kb)};
          for (host_tensor& w : want) w.fill(std::numeric_limits<double>::quiet_NaN());
          reference::block_importance(mask, q.view(), k.view(), v.view(), dout.view(), scale,
                                      want[0].view(), want[1].view());
          host_tensor got[2] = {mass.fetch(), grad.fetch()};
          // Blocks the mask drops are left as they were (NaN here); compare the kept ones.
          std::vector<bool> dropped(static_cast<std::size_t>(want[0].numel()));
          for (std::int64_t i = 0; i < want[0].numel(); ++i)
            dropped[static_cast<std::size_t>(i)] = std::isnan(want[0].get(i));
          for (int x = 0; x < 2; ++x) {
            for (std::int64_t i = 0; i < want[x].numel(); ++i) {
              if (!std::isnan(want[x].get(i))) continue;
              EXPECT_TRUE(std::isnan(got[x].get(i))) << "a dropped block was written";
              got[x].set(i, 0.0);
              want[x].set(i, 0.0);
            }
          }
          // dS reads <dO, O> with O rounded to q's dtype, as the gradients do.
          const double tol =
              tolerance(in, dtype::f32, 8) + (in == dtype::f64 ? 0 : 8 * unit_roundoff(in));
          rec.check("block_importance", backend, t, shape, got[0], want[0], tol, "block_mass");
          rec.check("block_importance", backend, t, shape, got[1], want[1], tol, "block_grad");
          // The mass without a backward (block_mass: from the forward's lse on CUDA).
          buffer light = buffer::output(dtype::f32, importance_rows, heads, kb);
          const std::size_t light_bytes = plan.block_mass_workspace_bytes(heads);
          buffer light_ws = buffer::scratch(light_bytes);
          plan.block_mass(bq.view(), bk.view(), lse_view, {.block_mass = light.view()}, {},
                          {light_bytes > 0 ? light_ws.view().data : nullptr, light_bytes});
          host_tensor mass_alone = light.fetch();
          for (std::int64_t i = 0; i < mass_alone.numel(); ++i) {
            if (!dropped[static_cast<std::size_t>(i)]) continue;
            EXPECT_TRUE(std::isnan(mass_alone.get(i))) << "block_mass wrote a dropped block";
            mass_alone.set(i, 0.0);
          }
          rec.check("block_mass", backend, t, shape, mass_alone, want[0], tol, "block_mass");
        });
      }
    }
  }
}

// A per-block score bias (attention_options::block_bias) and its gradient (dblock_bias) against
// the float64 reference over the expanded pattern with the bias per entry: per-head and shared
// biases, every tile shape of the CUDA kernels (G 16 and 32: mma.sync; 64 and 128: wgmma on sm_90),
// causal or not, ragged, dropped blocks left as they were.
void block_sparse_bias_cases(recorder& rec) {
  // (A block row's dB sum to 0 where it holds every key of its rows, Σ_j dS_ij = 0: the longest
  // sequence spans several blocks at every G, so that dB has a scale to be compared at.)
  const std::vector<std::int64_t> lens{70, 0, 33, 300};
  const std::int64_t heads = 2;
  for (const std::int64_t g : {16, 32, 64, 128}) {
    for (const bool causal : {false, true}) {
      const blocked_case c = make_blocked_case(
          lens, {.block = g, .p = 0.4, .causal = causal, .heads = heads, .seed = 7});
      const block_sparse_mask& mask = c.mask;
      const std::int64_t rows = c.rows, kb = c.kb, bias_rows = c.block_rows;
      const algorithm a = c.algo;
      const std::string& backend = c.backend;
      for (const std::int64_t bias_heads : {heads, std::int64_t{1}}) {
        const std::string shape = "G" + std::to_string(g) + (causal ? " causal" : "") +
                                  (bias_heads == 1 ? " shared bias" : " per-head bias");
        for (const dtype in : kDtypes) {
          const std::int64_t dim = 64;
          const types t{in, out_of(in)};
          rec.attempt("block_sparse_bias", backend, t, [&] {
            const auto plan = block_sparse_attention_plan::build(
                mask, kWhere, {.algo = a, .gradients = kWhere == device_kind::cuda});
            const double scale = effective_scale({}, dim);
            const host_tensor q = random(in, rows, heads, dim, 50),
                              k = random(in, rows, heads, dim, 51),
                              v = random(in, rows, heads, dim, 52),
                              dout = random(in, rows, heads, dim, 53),
                              bias = random(dtype::f32, bias_rows, bias_heads, kb, 54);
            const dtype grad = out_of(in);
            host_tensor zeros(in == dtype::f64 ? dtype::f64 : dtype::f32, bias_rows, heads, kb);
            zeros.fill(0.0);
            buffer bq(q), bk(k), bv(v), bdout(dout), bbias(bias), dbias(zeros),
                out = buffer::output(in, rows, heads, dim),
                lse = buffer::output(
                    kWhere == device_kind::cpu && in == dtype::f64 ? dtype::f64 : dtype::f32, rows,
                    heads, 1),
                dq = buffer::output(grad, rows, heads, dim),
                dk = buffer::output(grad, rows, heads, dim),
                dv = buffer::output(grad, rows, heads, dim);
            plan.run(bq.view(), bk.view(), bv.view(), out.view(),
                     {.lse = lse.view(), .block_bias = bbias.view()});
            host_tensor want(dtype::f64, rows, heads, dim), wq(dtype::f64, rows, heads, dim),
                wk(dtype::f64, rows, heads, dim), wv(dtype::f64, rows, heads, dim),
                wb(dtype::f64, bias_rows, heads, kb);
            wb.fill(0.0);
            reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), want.view(),
                                              scale, bias.view());
            rec.check("block_sparse_bias", backend, t, shape, out.fetch(), want,
                      tolerance(in, t.out, 4), "out");
            // (dblock_bias's sums take the workspace of a backward with importance.)
            const std::size_t bytes = plan.backward_workspace_bytes(heads, true);
            buffer ws = buffer::scratch(bytes);
            plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                          dq.view(), dk.view(), dv.view(),
                          {.block_bias = bbias.view(), .dblock_bias = dbias.view()}, {},
                          {bytes > 0 ? ws.view().data : nullptr, bytes});
            reference::block_sparse_attention_backward(mask, q.view(), k.view(), v.view(),
                                                       dout.view(), wq.view(), wk.view(), wv.view(),
                                                       scale, bias.view(), wb.view());
            const double tol =
                tolerance(in, grad, 8) + (in == dtype::f64 ? 0 : unit_roundoff(in) * 8);
            rec.check("block_sparse_bias", backend, t, shape, dq.fetch(), wq, tol, "dq");
            rec.check("block_sparse_bias", backend, t, shape, dk.fetch(), wk, tol, "dk");
            rec.check("block_sparse_bias", backend, t, shape, dv.fetch(), wv, tol, "dv");
            const host_tensor db = dbias.fetch();
            rec.check("block_sparse_bias", backend, t, shape, db, wb, tol, "dblock_bias");
            // The same bits on a second run (fixed orders of sums, no atomics).
            plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                          dq.view(), dk.view(), dv.view(),
                          {.block_bias = bbias.view(), .dblock_bias = dbias.view()}, {},
                          {bytes > 0 ? ws.view().data : nullptr, bytes});
            const host_tensor again = dbias.fetch();
            EXPECT_EQ(std::memcmp(db.data(), again.data(), db.size_bytes()), 0)
                << "dblock_bias differs between runs";
          });
        }
      }
    }
  }
}

// Top-k masks selected from q and k (the CPU's topk_block_mask, the device's
// topk_block_sparse_plan): every selected row against the pooled float64 scores, and attention
// under the selection against the float64 reference under that mask.
void topk_cases(recorder& rec) {
  const std::vector<std::int64_t> cu{0, 300, 301, 818};
  const std::int64_t heads = 2;
  const std::string backend = kWhere == device_kind::cuda ? "cuda_topk_block" : "cpu_topk_block";
  for (const std::int64_t g : {16, 64, 128}) {
    for (const bool causal : {false, true}) {
      for (const std::int64_t dim : {64, 128}) {
        const topk_mask_options o{
            .block = g, .top_k = 3, .causal = causal, .keep_diagonal = g != 64};
        const std::string shape = "G" + std::to_string(g) + (causal ? " causal" : "") + ", d " +
                                  std::to_string(dim) + ", top 3" +
                                  (o.keep_diagonal ? " + diagonal" : "");
        for (const dtype in : kDtypes) {
          const types t{in, out_of(in)};
          rec.attempt("topk_block_attention", backend, t, [&] {
            if (kWhere == device_kind::cuda && in != dtype::f16 && in != dtype::bf16)
              throw not_supported("the device's top-k selection takes f16 and bf16");
            const host_tensor q = random(in, cu.back(), heads, dim, 110 + g),
                              k = random(in, cu.back(), heads, dim, 111 + g),
                              v = random(in, cu.back(), heads, dim, 112 + g);
            buffer bq(q), bk(k), bv(v), out = buffer::output(t.out, cu.back(), heads, dim);
            block_sparse_mask mask;
            if (kWhere == device_kind::cuda) {
              auto plan = topk_block_sparse_plan::build(cu, cu, heads, dim, o);
              plan.select(bq.view(), bk.view());
              plan.run(bq.view(), bk.view(), bv.view(), out.view());
              mask = plan.mask();
            } else {
              mask = topk_block_mask(q.view(), k.view(), cu, cu, o);
              block_sparse_attention_plan::build(mask).run(bq.view(), bk.view(), bv.view(),
                                                           out.view());
            }
            ASSERT_NO_FATAL_FAILURE(test::expect_topk_rows(mask, q, k, o)) << shape;
            host_tensor want(dtype::f64, cu.back(), heads, dim);
            reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), want.view(),
                                              effective_scale({}, dim));
            rec.check("topk_block_attention", backend, t, shape, out.fetch(), want,
                      tolerance(in, t.out, 4));
          });
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
        const std::int64_t words = (f_out + 31) / 32;
        const bool fused = plan.fused(f_in, f_out, t.in, order);  // it writes P x
        buffer bx(x), bw(w), bb(bias), out = buffer::output(t.out, p.rows, 1, f_out),
                                       mask = buffer::output(dtype::f32, p.rows * words, 1, 1),
                                       ax = buffer::output(t.in, p.rows, 1, f_in),
                                       workspace = buffer::scratch(bytes);
        plan.forward({.x = bx.view(),
                      .w = bw.view(),
                      .bias = bb.view(),
                      .out = out.view(),
                      .relu_mask = static_cast<std::uint32_t*>(mask.view().data),
                      .ax = fused ? ax.view() : tensor_view{},
                      .order = order},
                     {}, {workspace.view().data, bytes});
        host_tensor want(dtype::f64, p.rows, 1, f_out);
        reference::gcn_fused(p, x.view(), w.view(), bias.view(), true, want.view());
        rec.check("gcn_fused_layer", backend, t, shape, out.fetch(), want,
                  tolerance(t.in, t.out, 16));

        // The backward from the forward's ReLU mask (and P x, where the fused order wrote it),
        // against the float64 gradients given that mask: an output within rounding of 0 may fall
        // either way, and a flipped bit moves the gradients by a whole dout value.
        const host_tensor dout = random(t.out, p.rows, 1, f_out, 63);
        const std::size_t bwd_bytes = plan.backward_workspace_bytes(f_in, f_out, t.in, order);
        buffer bdout(dout),
            dx = buffer::output(t.out, p.rows, 1, f_in), dw = buffer::output(t.out, f_in, 1, f_out),
            dbias = buffer::output(dtype::f32, 1, 1, f_out), bwd_ws = buffer::scratch(bwd_bytes);
        plan.backward({.dout = bdout.view(),
                       .relu_mask = static_cast<const std::uint32_t*>(mask.view().data),
                       .x = bx.view(),
                       .w = bw.view(),
                       .ax = fused ? ax.view() : tensor_view{},
                       .dx = dx.view(),
                       .dw = dw.view(),
                       .dbias = dbias.view(),
                       .order = order},
                      {}, {bwd_ws.view().data, bwd_bytes});
        const host_tensor bits = mask.fetch();
        std::vector<std::uint32_t> relu(static_cast<std::size_t>(p.rows * words));
        std::memcpy(relu.data(), bits.data(), relu.size() * sizeof(std::uint32_t));
        host_tensor wx(dtype::f64, p.rows, 1, f_in), ww(dtype::f64, f_in, 1, f_out),
            wb(dtype::f64, 1, 1, f_out);
        reference::gcn_fused_backward(p, x.view(), w.view(), relu, dout.view(), wx.view(),
                                      ww.view(), wb.view());
        // dZ is rounded to x's dtype before the products.
        const double tol = tolerance(t.in, t.out, 16) + 8 * unit_roundoff(t.in);
        rec.check("gcn_fused_backward", backend, t, shape, dx.fetch(), wx, tol, "dx");
        rec.check("gcn_fused_backward", backend, t, shape, dw.fetch(), ww, tol, "dw");
        rec.check("gcn_fused_backward", backend, t, shape, dbias.fetch(), wb,
                  tolerance(t.in, dtype::f32, 16) + 8 * unit_roundoff(t.in), "dbias");
      });
    }
  }
}

// --- GAT's attention: forward and backward -----------------------------------------------------

// With attention dropout drawn by the plan: entry e's factor in head h is input edge e's draw
// (no keep_index), against the reference given those factors.
void gat_cases(recorder& rec) {
  const std::uint64_t seed = 0x243F6A8885A308D3ull, offset = 3;
  buffer bstate = dropout_state(seed, offset);
  for (const auto& s : shapes()) {
    const csr_graph& g = s.pattern;
    const std::string backend = kWhere == device_kind::cuda ? "cuda_gat" : "cpu_layers";
    for (const auto& [heads, width, p] :
         std::vector<std::tuple<std::int64_t, std::int64_t, double>>{
             {2, 16, 0.0}, {3, 5, 0.0}, {1, 64, 0.0}, {2, 16, 0.3}, {40, 4, 0.3}}) {
      const std::string shape = s.name + ", " + std::to_string(heads) + " x " +
                                std::to_string(width) + (p > 0 ? ", dropout" : "");
      const attention_dropout drop{p, static_cast<const std::uint64_t*>(bstate.view().data)};
      host_tensor keep(dtype::f64, g.nnz(), heads, 1);
      for (std::int64_t e = 0; e < g.nnz(); ++e)
        for (std::int32_t h = 0; h < heads; ++h)
          keep.set(e * heads + h, edge_dropout_factor(drop, seed, offset, e, h));
      const tensor_view ref_keep = p > 0 ? keep.view() : tensor_view{};
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
                        .lse = lse.view(),
                        .dropout = drop});
          host_tensor want(dtype::f64, g.rows, heads, width);
          reference::gat(g, x.view(), a_src.view(), a_dst.view(), ref_keep, 0.2, want.view(),
                         tensor_view{});
          rec.check("gat_attention", backend, t, shape, out.fetch(), want, tolerance(in, t.out));
          buffer dx = buffer::output(t.out, g.cols, heads, width),
                 da_src = buffer::output(dtype::f32, g.cols, heads, 1),
                 da_dst = buffer::output(dtype::f32, g.rows, heads, 1);
          const std::size_t bytes = plan.backward_workspace_bytes(heads, width);
          buffer workspace = buffer::scratch(bytes);
          plan.backward({.x = bx.view(),
                         .a_src = bs.view(),
                         .a_dst = bd.view(),
                         .dropout = drop,
                         .out = out.view(),
                         .lse = lse.view(),
                         .dout = bdout.view(),
                         .dx = dx.view(),
                         .da_src = da_src.view(),
                         .da_dst = da_dst.view()},
                        {}, {workspace.view().data, bytes});
          host_tensor wx(dtype::f64, g.cols, heads, width), ws(dtype::f64, g.cols, heads, 1),
              wd(dtype::f64, g.rows, heads, 1);
          reference::gat_backward(g, x.view(), a_src.view(), a_dst.view(), ref_keep, 0.2,
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

// --- attention over a multigraph (edge_attention_plan) ------------------------------------

// A multigraph where the plan runs, as edge_attention_plan reads it: 150 targets x 140 sources,
// random edges with repeated pairs and targets without edges, target 0 with 300 edges and source 7
// with 200 (both past heavy_degree: the thread-block paths). `edges` lists them in input order
// (src: target, dst: source), the reference's view.
class device_multigraph {
 public:
  coo_graph edges;

  device_multigraph() {
    edges.rows = 150;
    edges.cols = 140;
    const auto add = [&](std::int64_t i, std::int64_t j) {
      edges.src.push_back(i);
      edges.dst.push_back(j);
    };
    std::uint64_t state = 12345;
    const auto next = [&](std::uint64_t n) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<std::int64_t>((state >> 33) % n);
    };
    for (std::int64_t x = 0; x < 300; ++x) add(0, next(140));  // repeats within
    for (std::int64_t i = 0; i < 200; ++i) add(i % 150, 7);    // 50 repeated pairs
    for (std::int64_t i = 1; i < 150; ++i) {
      if (i % 9 == 4) continue;  // targets without other edges (some keep source 7's)
      for (std::int64_t x = next(6); x > 0; --x) {
        add(i, next(140));
        if (x == 2) add(i, edges.dst.back());  // a repeated pair
      }
    }
    for (std::int64_t i = 0; i < 150; i += 10) {  // targets with no edge at all
      for (std::size_t p = 0; p < edges.src.size(); ++p)
        if (edges.src[p] == i + 5) edges.src[p] = i + 6;
    }
    build();
  }

  multigraph_view view() const { return view_; }

 private:
  void build() {
    const std::int64_t e = edges.nnz(), heavy = edge_attention_plan::heavy_degree;
    std::vector<std::int64_t> order(static_cast<std::size_t>(e)), row_ptr(edges.rows + 1, 0),
        col_ptr(edges.cols + 1, 0), by_source(static_cast<std::size_t>(e));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t a, std::int64_t b) { return edges.src[a] < edges.src[b]; });
    std::vector<std::int32_t> src, dst, heavy_rows, heavy_cols;
    for (const std::int64_t p : order) {
      src.push_back(static_cast<std::int32_t>(edges.dst[p]));
      dst.push_back(static_cast<std::int32_t>(edges.src[p]));
      ++row_ptr[edges.src[p] + 1];
      ++col_ptr[edges.dst[p] + 1];
    }
    std::partial_sum(row_ptr.begin(), row_ptr.end(), row_ptr.begin());
    std::partial_sum(col_ptr.begin(), col_ptr.end(), col_ptr.begin());
    std::iota(by_source.begin(), by_source.end(), 0);
    std::stable_sort(by_source.begin(), by_source.end(),
                     [&](std::int64_t a, std::int64_t b) { return src[a] < src[b]; });
    for (std::int64_t i = 0; i < edges.rows; ++i)
      if (row_ptr[i + 1] - row_ptr[i] > heavy) heavy_rows.push_back(static_cast<std::int32_t>(i));
    for (std::int64_t j = 0; j < edges.cols; ++j)
      if (col_ptr[j + 1] - col_ptr[j] > heavy) heavy_cols.push_back(static_cast<std::int32_t>(j));
    const auto upload = [&](const auto& v) -> const void* {
      const std::size_t bytes = v.size() * sizeof(v[0]);
      host_tensor h(dtype::f32, static_cast<std::int64_t>(bytes / 4) + 1, 1, 1);
      std::memcpy(h.data(), v.data(), bytes);
      return arrays_.emplace_back(h).view().data;
    };
    arrays_.reserve(8);
    view_ = {.rows = edges.rows,
             .cols = edges.cols,
             .edges = e,
             .row_ptr = static_cast<const std::int64_t*>(upload(row_ptr)),
             .src = static_cast<const std::int32_t*>(upload(src)),
             .dst = static_cast<const std::int32_t*>(upload(dst)),
             .edge = static_cast<const std::int64_t*>(upload(order)),
             .col_ptr = static_cast<const std::int64_t*>(upload(col_ptr)),
             .by_source = static_cast<const std::int64_t*>(upload(by_source)),
             .heavy = heavy,
             .heavy_row_count = static_cast<std::int64_t>(heavy_rows.size()),
             .heavy_col_count = static_cast<std::int64_t>(heavy_cols.size()),
             .heavy_rows = static_cast<const std::int32_t*>(upload(heavy_rows)),
             .heavy_cols = static_cast<const std::int32_t*>(upload(heavy_cols)),
             .where = kWhere};
    EXPECT_FALSE(heavy_rows.empty() || heavy_cols.empty()) << "no heavy line to test";
  }

  std::vector<buffer> arrays_;
  multigraph_view view_;
};

void edge_attention_cases(recorder& rec) {
  const device_multigraph m;
  const coo_graph& g = m.edges;
  const std::int64_t e = g.nnz();
  const bool cuda = kWhere == device_kind::cuda;
  const std::string backend = cuda ? "cuda_edge_attention" : "cpu_edge_attention";
  // TransformerConv: heads x channels, edge features (padded to the kernels' width), dropout;
  // narrow: out_edge, dout_edge and every gradient in the operands' dtype (else f32).
  struct config {
    std::int64_t heads, dim, features;
    bool keep, narrow = false;
  };
  for (const config c : {config{2, 16, 5, false}, config{4, 64, 16, true, true},
                         config{1, 128, 0, true}, config{3, 32, 0, false, true}}) {
    const std::int64_t f = c.features > 0 && cuda
                               ? edge_attention_plan::feature_width(c.dim, c.features)
                               : c.features;  // the CPU engine: any feature count
    const std::string shape = "150x140 multigraph, " + std::to_string(c.heads) + " x " +
                              std::to_string(c.dim) + ", F " + std::to_string(f) +
                              (c.keep ? ", dropout" : "") + (c.narrow ? ", narrow" : "");
    for (const dtype in : kDtypes) {
      const types t{in, in};
      const dtype res = c.narrow ? in : dtype::f32;  // out_edge's and the gradients' dtype
      rec.attempt("edge_attention", backend, t, [&] {
        const auto plan = edge_attention_plan::build(m.view());
        const std::int64_t h = c.heads, d = c.dim;
        const double scale = effective_scale({}, d);
        const host_tensor q = random(in, g.rows, h, d, 120), k = random(in, g.cols, h, d, 121),
                          v = random(in, g.cols, h, d, 122),
                          r = f > 0 ? random(in, g.rows, h, f, 123) : host_tensor(),
                          a = f > 0 ? random(in, e, 1, f, 124) : host_tensor(),
                          dout = random(in, g.rows, h, d, 125),
                          dout_edge = f > 0 ? random(res, g.rows, h, f, 126) : host_tensor();
        host_tensor keep(dtype::f32, e, h, 1);
        for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, i % 5 == 3 ? 0.0 : 1.25);
        buffer bq(q), bk(k), bv(v), bdout(dout), bkeep(keep),
            out = buffer::output(in, g.rows, h, d), lse = buffer::output(dtype::f32, g.rows, h, 1);
        std::optional<buffer> br, ba, bdout_edge, out_edge, dr, da;
        if (f > 0) {
          br.emplace(r);
          ba.emplace(a);
          bdout_edge.emplace(dout_edge);
          out_edge.emplace(buffer::output(res, g.rows, h, f));
          dr.emplace(buffer::output(res, g.rows, h, f));
          da.emplace(buffer::output(res, e, 1, f));
        }
        const auto view_of = [](std::optional<buffer>& b) { return b ? b->view() : tensor_view{}; };
        const tensor_view keep_view = c.keep ? bkeep.view() : tensor_view{};
        plan.forward({.q = bq.view(),
                      .k = bk.view(),
                      .v = bv.view(),
                      .r = view_of(br),
                      .a = view_of(ba),
                      .out = out.view(),
                      .out_edge = view_of(out_edge),
                      .lse = lse.view(),
                      .keep = keep_view,
                      .scale = scale});
        host_tensor want(dtype::f64, g.rows, h, d),
            want_edge(dtype::f64, g.rows, h, std::max<std::int64_t>(f, 1)),
            want_lse(dtype::f64, g.rows, h, 1);
        // The reference's views of the optional inputs.
        const tensor_view ref_r = f > 0 ? r.view() : tensor_view{},
                          ref_a = f > 0 ? a.view() : tensor_view{},
                          ref_keep = c.keep ? keep.view() : tensor_view{};
        reference::edge_attention(g, q.view(), k.view(), v.view(), ref_r, ref_a, ref_keep, scale,
                                  want.view(), f > 0 ? want_edge.view() : tensor_view{},
                                  want_lse.view());
        rec.check("edge_attention", backend, t, shape, out.fetch(), want, tolerance(in, in, 8),
                  "out");
        const auto [lse_got, lse_want] = test::finite_lse(lse.fetch(), want_lse);
        rec.check("edge_attention", backend, t, shape, lse_got, lse_want,
                  tolerance(in, dtype::f32, 8), "lse");
        if (f > 0)
          rec.check("edge_attention", backend, t, shape, out_edge->fetch(), want_edge,
                    tolerance(in, res, 8), "out_edge");

        buffer dq = buffer::output(res, g.rows, h, d), dk = buffer::output(res, g.cols, h, d),
               dv = buffer::output(res, g.cols, h, d);
        // Exactly the bytes the gradients' dtype needs (bf16 weights for 16-bit gradients).
        const std::size_t bytes = plan.backward_workspace_bytes(h, res);
        buffer ws = buffer::scratch(bytes);
        plan.backward({.q = bq.view(),
                       .k = bk.view(),
                       .v = bv.view(),
                       .r = view_of(br),
                       .a = view_of(ba),
                       .out = out.view(),
                       .out_edge = view_of(out_edge),
                       .lse = lse.view(),
                       .dout = bdout.view(),
                       .dout_edge = view_of(bdout_edge),
                       .dq = dq.view(),
                       .dk = dk.view(),
                       .dv = dv.view(),
                       .dr = view_of(dr),
                       .da = view_of(da),
                       .keep = keep_view,
                       .scale = scale},
                      {}, {ws.view().data, bytes});
        host_tensor wq(dtype::f64, g.rows, h, d), wk(dtype::f64, g.cols, h, d),
            wv(dtype::f64, g.cols, h, d), wr(dtype::f64, g.rows, h, std::max<std::int64_t>(f, 1)),
            wa(dtype::f64, e, 1, std::max<std::int64_t>(f, 1));
        reference::edge_attention_backward(
            g, q.view(), k.view(), v.view(), ref_r, ref_a, ref_keep, scale, dout.view(),
            f > 0 ? dout_edge.view() : tensor_view{}, wq.view(), wk.view(), wv.view(),
            f > 0 ? wr.view() : tensor_view{}, f > 0 ? wa.view() : tensor_view{});
        // out (rounded to q's dtype) enters the backward through D = <dout, out>.
        const double tol = tolerance(in, res, 8) + 8 * unit_roundoff(in);
        rec.check("edge_attention_backward", backend, t, shape, dq.fetch(), wq, tol, "dq");
        rec.check("edge_attention_backward", backend, t, shape, dk.fetch(), wk, tol, "dk");
        rec.check("edge_attention_backward", backend, t, shape, dv.fetch(), wv, tol, "dv");
        if (f > 0) {
          rec.check("edge_attention_backward", backend, t, shape, dr->fetch(), wr, tol, "dr");
          rec.check("edge_attention_backward", backend, t, shape, da->fetch(), wa, tol, "da");
        }
      });
    }
  }
  // GAT: heads x channels, an edge term, dropout.
  for (const config c : {config{2, 16, 1, true}, config{1, 64, 0, false}, config{4, 8, 1, false}}) {
    const bool edge_term = c.features > 0;
    const std::string shape = "150x140 multigraph, " + std::to_string(c.heads) + " x " +
                              std::to_string(c.dim) + (edge_term ? ", edge term" : "") +
                              (c.keep ? ", dropout" : "");
    for (const dtype in : kDtypes) {
      const types t{in, in};
      rec.attempt("edge_gat", backend, t, [&] {
        const auto plan = edge_attention_plan::build(m.view());
        const std::int64_t h = c.heads, d = c.dim;
        const host_tensor x = random(in, g.cols, h, d, 130),
                          a_src = random(dtype::f32, g.cols, h, 1, 131, -2.0, 2.0),
                          a_dst = random(dtype::f32, g.rows, h, 1, 132, -2.0, 2.0),
                          a_edge = random(dtype::f32, e, h, 1, 133, -2.0, 2.0),
                          dout = random(in, g.rows, h, d, 134);
        host_tensor keep(dtype::f32, e, h, 1);
        for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, i % 4 == 1 ? 0.0 : 1.5);
        buffer bx(x), bs(a_src), bd(a_dst), be(a_edge), bdout(dout), bkeep(keep),
            out = buffer::output(in, g.rows, h, d), lse = buffer::output(dtype::f32, g.rows, h, 1),
            dx = buffer::output(dtype::f32, g.cols, h, d),
            ds = buffer::output(dtype::f32, g.cols, h, 1),
            dd = buffer::output(dtype::f32, g.rows, h, 1), de = buffer::output(dtype::f32, e, h, 1);
        const tensor_view edge_view = edge_term ? be.view() : tensor_view{},
                          keep_view = c.keep ? bkeep.view() : tensor_view{};
        plan.gat_forward({.x = bx.view(),
                          .a_src = bs.view(),
                          .a_dst = bd.view(),
                          .a_edge = edge_view,
                          .out = out.view(),
                          .lse = lse.view(),
                          .keep = keep_view});
        const tensor_view ref_edge = edge_term ? a_edge.view() : tensor_view{},
                          ref_keep = c.keep ? keep.view() : tensor_view{};
        host_tensor want(dtype::f64, g.rows, h, d), want_lse(dtype::f64, g.rows, h, 1);
        reference::edge_gat(g, x.view(), a_src.view(), a_dst.view(), ref_edge, ref_keep, 0.2,
                            want.view(), want_lse.view());
        rec.check("edge_gat", backend, t, shape, out.fetch(), want, tolerance(in, in, 8), "out");
        const auto [lse_got, lse_want] = test::finite_lse(lse.fetch(), want_lse);
        rec.check("edge_gat", backend, t, shape, lse_got, lse_want, tolerance(in, dtype::f32, 8),
                  "lse");
        const std::size_t bytes = plan.backward_workspace_bytes(h);
        buffer ws = buffer::scratch(bytes);
        plan.gat_backward({.x = bx.view(),
                           .a_src = bs.view(),
                           .a_dst = bd.view(),
                           .a_edge = edge_view,
                           .out = out.view(),
                           .lse = lse.view(),
                           .dout = bdout.view(),
                           .dx = dx.view(),
                           .da_src = ds.view(),
                           .da_dst = dd.view(),
                           .da_edge = edge_term ? de.view() : tensor_view{},
                           .keep = keep_view},
                          {}, {ws.view().data, bytes});
        host_tensor wx(dtype::f64, g.cols, h, d), ws_(dtype::f64, g.cols, h, 1),
            wd(dtype::f64, g.rows, h, 1), we(dtype::f64, e, h, 1);
        reference::edge_gat_backward(g, x.view(), a_src.view(), a_dst.view(), ref_edge, ref_keep,
                                     0.2, dout.view(), wx.view(), ws_.view(), wd.view(),
                                     edge_term ? we.view() : tensor_view{});
        const double tol = tolerance(in, dtype::f32, 8) + 8 * unit_roundoff(in);
        rec.check("edge_gat_backward", backend, t, shape, dx.fetch(), wx, tol, "dx");
        rec.check("edge_gat_backward", backend, t, shape, ds.fetch(), ws_, tol, "da_src");
        rec.check("edge_gat_backward", backend, t, shape, dd.fetch(), wd, tol, "da_dst");
        if (edge_term)
          rec.check("edge_gat_backward", backend, t, shape, de.fetch(), we, tol, "da_edge");
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
  host_tensor ids_h(dtype::f64, rows, 1, 1);  // the int64 ids' bytes
  std::memcpy(ids_h.data(), ids.data(), ids.size() * sizeof(std::int64_t));
  buffer bids(ids_h);
  // Attention dropout's generator state {seed, offset}, on the device as the kernels read it.
  const std::uint64_t seed = 0x9E3779B97F4A7C15ull, offset = 77;
  buffer bstate = dropout_state(seed, offset);
  // Each row's first row of its segment (the pair bias's places: key j at j - first(i)).
  std::vector<std::int64_t> first(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i)
    first[i] = i > 0 && ids[i] == ids[i - 1] ? first[i - 1] : static_cast<std::int64_t>(i);
  const std::int64_t places = 72;  // M >= the longest segment (70)
  const std::string backend = "cuda_segments";
  // bias: 0 none, 1 a pair bias per head, 2 one shared by the heads (d 64 only).
  for (const std::int64_t dim : {16, 32, 64, 128})
    for (const double p : {0.0, 0.3})
      for (const int bias_kind : {0, 1, 2}) {
        if (bias_kind == 2 && dim != 64) continue;
        const std::string shape = "5 segments, d " + std::to_string(dim) +
                                  (p > 0 ? ", dropout" : "") +
                                  (bias_kind == 1   ? ", pair bias"
                                   : bias_kind == 2 ? ", shared pair bias"
                                                    : "");
        const attention_dropout drop{p, static_cast<const std::uint64_t*>(bstate.view().data)};
        for (const dtype in : kDtypes) {
          const types t{in, in};
          rec.attempt("segment_attention", backend, t, [&] {
            const auto plan = segment_attention_plan::build({rows, bids.view().data, true, 0});
            const std::int64_t heads = 2, bias_heads = bias_kind == 2 ? 1 : heads;
            const host_tensor q = random(in, rows, heads, dim, 90),
                              k = random(in, rows, heads, dim, 91),
                              v = random(in, rows, heads, dim, 92),
                              dout = random(in, rows, heads, dim, 93),
                              bias = random(dtype::f32, rows, bias_heads, places, 94);
            buffer bq(q), bk(k), bv(v), bdout(dout), bbias(bias),
                dbias(host_tensor(dtype::f32, rows, heads, places)),  // zeros: places of no pair
                out = buffer::output(in, rows, heads, dim),
                lse = buffer::output(dtype::f32, rows, heads, 1),
                dq = buffer::output(dtype::f32, rows, heads, dim),
                dk = buffer::output(dtype::f32, rows, heads, dim),
                dv = buffer::output(dtype::f32, rows, heads, dim),
                ws = buffer::scratch(plan.backward_workspace_bytes(heads));
            const workspace_view w{ws.view().data, plan.backward_workspace_bytes(heads)};
            const tensor_view bias_view = bias_kind > 0 ? bbias.view() : tensor_view{};
            const tensor_view dbias_view = bias_kind > 0 ? dbias.view() : tensor_view{};
            plan.run(bq.view(), bk.view(), bv.view(), out.view(),
                     {.lse = lse.view(), .bias = bias_view, .dropout = drop}, w);
            plan.backward(bq.view(), bk.view(), bv.view(), out.view(), lse.view(), bdout.view(),
                          dq.view(), dk.view(), dv.view(),
                          {.bias = bias_view, .dbias = dbias_view, .dropout = drop}, w);
            const double scale = effective_scale({}, dim);
            const auto pairs = static_cast<std::int64_t>(coo.src.size());
            host_tensor want(dtype::f64, rows, heads, dim), wq(dtype::f64, rows, heads, dim),
                wk(dtype::f64, rows, heads, dim), wv(dtype::f64, rows, heads, dim);
            // The multigraph reference over the segments' pairs, each with the factor the draw
            // gives; the pair bias as its feature term: r one-hot per head, a_p = the pair's bias
            // per head, so that da_p is the bias's gradient per head.
            host_tensor keep(dtype::f64, pairs, heads, 1), r(dtype::f64, rows, heads, heads),
                a(dtype::f64, pairs, 1, heads), da(dtype::f64, pairs, 1, heads),
                dr(dtype::f64, rows, heads, heads);
            for (std::int64_t i = 0; i < rows; ++i)
              for (std::int64_t h = 0; h < heads; ++h) r.set((i * heads + h) * heads + h, 1.0);
            for (std::int64_t e = 0; e < pairs; ++e) {
              const std::int64_t i = coo.src[static_cast<std::size_t>(e)],
                                 place = coo.dst[static_cast<std::size_t>(e)] -
                                         first[static_cast<std::size_t>(i)];
              for (std::int32_t h = 0; h < heads; ++h) {
                keep.set(e * heads + h,
                         dropout_factor(drop, seed, offset, coo.src[static_cast<std::size_t>(e)],
                                        coo.dst[static_cast<std::size_t>(e)], h));
                a.set(e * heads + h,
                      bias.get((i * bias_heads + (bias_kind == 2 ? 0 : h)) * places + place));
              }
            }
            const tensor_view rv = bias_kind > 0 ? r.view() : tensor_view{},
                              av = bias_kind > 0 ? a.view() : tensor_view{};
            reference::edge_attention(coo, q.view(), k.view(), v.view(), rv, av, keep.view(), scale,
                                      want.view(), {}, {});
            reference::edge_attention_backward(
                coo, q.view(), k.view(), v.view(), rv, av, keep.view(), scale, dout.view(), {},
                wq.view(), wk.view(), wv.view(), bias_kind > 0 ? dr.view() : tensor_view{},
                bias_kind > 0 ? da.view() : tensor_view{});
            rec.check("segment_attention", backend, t, shape, out.fetch(), want,
                      tolerance(in, in, 4));
            const double tol = tolerance(in, dtype::f32, 8) + unit_roundoff(in) * 8;
            rec.check("segment_attention", backend, t, shape, dq.fetch(), wq, tol, "dq");
            rec.check("segment_attention", backend, t, shape, dk.fetch(), wk, tol, "dk");
            rec.check("segment_attention", backend, t, shape, dv.fetch(), wv, tol, "dv");
            if (bias_kind > 0) {  // dL/dS per pair and head at its place, zeros elsewhere
              host_tensor wdb(dtype::f64, rows, heads, places);
              for (std::int64_t e = 0; e < pairs; ++e) {
                const std::int64_t i = coo.src[static_cast<std::size_t>(e)],
                                   place = coo.dst[static_cast<std::size_t>(e)] -
                                           first[static_cast<std::size_t>(i)];
                for (std::int64_t h = 0; h < heads; ++h)
                  wdb.set((i * heads + h) * places + place, da.get(e * heads + h));
              }
              rec.check("segment_attention", backend, t, shape, dbias.fetch(), wdb, tol, "dbias");
            }
          });
        }
      }
}

// --- per-head products (head_product, head_outer) ---------------------------------------------

// x [n, heads, a] (its heads side by side, or padded to a + 3 columns: strided views), w [heads,
// a, b], g [n, heads, b]: out = x w per head and dw = Σ_n xᵀ g per head against float64 loops;
// float32 only (other dtypes are invalid input, not cases). head_outer twice: the same bits.
void head_product_cases(recorder& rec) {
  const std::string backend = kWhere == device_kind::cuda ? "cuda_head_product" : "cpu_loops";
  const types t{dtype::f32, dtype::f32};
  struct size {
    std::int64_t n, heads, a, b, pad;
  };
  for (const size z : {size{2500, 3, 16, 16, 3}, size{2500, 3, 16, 16, 0}, size{45, 9, 8, 4, 0},
                       size{1, 2, 5, 7, 3}, size{1030, 4, 32, 8, 3}, size{0, 2, 4, 4, 3}}) {
    const std::string shape = std::to_string(z.n) + " x " + std::to_string(z.heads) + " heads, " +
                              std::to_string(z.a) + " -> " + std::to_string(z.b) +
                              (z.pad > 0 ? ", x strided" : "");
    rec.attempt("head_product", backend, t, [&] {
      const std::int64_t wide = z.a + z.pad;
      const host_tensor x = random(dtype::f32, z.n, z.heads, wide, 7 + z.a);
      const host_tensor w = random(dtype::f32, z.heads, z.a, z.b, 8 + z.b);
      const host_tensor g = random(dtype::f32, z.n, z.heads, z.b, 9 + z.n);
      buffer bx(x), bw(w), bg(g), out = buffer::output(dtype::f32, z.n, z.heads, z.b);
      buffer dw = buffer::output(dtype::f32, z.heads, z.a, z.b),
             again = buffer::output(dtype::f32, z.heads, z.a, z.b),
             ws = buffer::scratch(head_outer_workspace_bytes(z.n, z.heads, z.a, z.b));
      tensor_view xv = bx.view();
      xv.dim = z.a;  // the first a of each head's a + pad columns
      const auto xat = [&](std::int64_t n, std::int64_t h, std::int64_t i) {
        return x.get((n * z.heads + h) * wide + i);
      };
      host_tensor want(dtype::f64, z.n, z.heads, z.b), want_dw(dtype::f64, z.heads, z.a, z.b);
      want_dw.fill(0.0);
      for (std::int64_t n = 0; n < z.n; ++n)
        for (std::int64_t h = 0; h < z.heads; ++h)
          for (std::int64_t j = 0; j < z.b; ++j) {
            double sum = 0.0;
            for (std::int64_t i = 0; i < z.a; ++i) {
              sum += xat(n, h, i) * w.get((h * z.a + i) * z.b + j);
              const std::int64_t at = (h * z.a + i) * z.b + j;
              want_dw.set(at, want_dw.get(at) + xat(n, h, i) * g.get((n * z.heads + h) * z.b + j));
            }
            want.set((n * z.heads + h) * z.b + j, sum);
          }
      const std::size_t ws_bytes = head_outer_workspace_bytes(z.n, z.heads, z.a, z.b);
      if (z.n > 0) {
        head_product(xv, bw.view(), out.view());
        rec.check("head_product", backend, t, shape, out.fetch(), want, tolerance(t.in, t.out));
      }
      head_outer(xv, bg.view(), dw.view(), ws.view().data, ws_bytes);
      head_outer(xv, bg.view(), again.view(), ws.view().data, ws_bytes);
      const host_tensor got = dw.fetch(), got_again = again.fetch();
      rec.check("head_outer", backend, t, shape, got, want_dw, tolerance(t.in, t.out, 16));
      EXPECT_EQ(std::memcmp(got.data(), got_again.data(), got.size_bytes()), 0)
          << "head_outer: two runs differ (" << shape << ")";
    });
  }
}

// Every op's registration: add one here for a new op.
struct registration {
  const char* name;  // what TRISPARSE_OPS names it by
  std::function<void(recorder&)> cases;
};

const std::vector<registration>& registry() {
  static const std::vector<registration> all{
      {"attention", attention_cases},
      {"attention_bias", attention_bias_cases},
      {"sparse", sparse_cases},
      {"block_sparse", block_sparse_cases},
      {"block_sparse_dropout", block_sparse_dropout_cases},
      {"block_importance", block_importance_cases},
      {"block_sparse_bias", block_sparse_bias_cases},
      {"topk", topk_cases},
      {"gcn", gcn_cases},
      {"gcn_fused", gcn_fused_cases},
      {"agnn", agnn_cases},
      {"gat", gat_cases},
      {"edge_attention", edge_attention_cases},
      {"segment", segment_cases},
      {"head_product", head_product_cases},
  };
  return all;
}

// TRISPARSE_OPS (a comma-separated list of registration names, e.g. "block_sparse_dropout,segment"
// for a sanitizer run over one kernel family): only those run, and the coverage check is skipped.
bool selected(const char* name, const char* only) {
  if (only == nullptr) return true;
  const std::string list = std::string(",") + only + ",";
  return list.find(std::string(",") + name + ",") != std::string::npos;
}

TEST(EveryOp, AgainstTheFloat64Reference) {
  if (kWhere == device_kind::cuda && !cuda_available())
    GTEST_SKIP() << "no CUDA device visible: skipping";
  const char* only = std::getenv("TRISPARSE_OPS");
  recorder rec;
  for (const auto& r : registry())
    if (selected(r.name, only)) r.cases(rec);
  rec.print();
  if (only != nullptr) return;
  // Every registered op ran somewhere on this device.
  for (const char* op :
       {"attention", "attention_backward", "attention_bias", "spmm", "sddmm", "softmax",
        "block_sparse_attention", "block_sparse_backward", "block_importance", "block_mass",
        "block_sparse_bias", "block_sparse_dropout", "topk_block_attention", "gcn_layer",
        "gcn_fused_layer", "gcn_fused_backward", "agnn_layer", "gat_attention", "gat_backward"})
    EXPECT_TRUE(rec.ops().count(op)) << op << ": no case ran on " << to_string(kWhere);
  for (const char* op : {"head_product", "head_outer"})
    EXPECT_TRUE(rec.ops().count(op)) << op << ": no case ran on " << to_string(kWhere);
  if (kWhere == device_kind::cuda) {
    for (const char* op : {"segment_attention", "edge_attention", "edge_attention_backward",
                           "edge_gat", "edge_gat_backward"})
      EXPECT_TRUE(rec.ops().count(op)) << op << ": no case ran on " << to_string(kWhere);
  }
}

}  // namespace
}  // namespace trisparse
