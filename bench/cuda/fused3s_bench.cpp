// GPU fused 3S benchmark: per graph, plan build time (from a host CSR and from a device CSR),
// kernel time (median of event-timed runs after warm-up, rotating input sets larger than the L2;
// GPU time and call time), useful GFLOP/s (4·nnz·d·heads), compulsory bandwidth, the in-project
// baselines (cuSPARSE pipeline fp32/fp16, dense cuBLAS), and a check of every timed output against
// float64 on sampled rows. One JSON object per line.
//   bench_fused3s [--dim D] [--heads H] [--repeat R] [--dtype f16|bf16] [--split N,N,...] [--team
//   N,N,...]
//                 [--no-baselines] [--training] [--rmat SCALE:EF]... [--er N:DEG]... [--batch
//                 G:MIN:MAX]... GRAPH...
#include <cuda_runtime.h>
#include <omp.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "baselines.hpp"
#include "common.hpp"
#include "trisparse/trisparse.hpp"

namespace {

using namespace trisparse;
using bench::check;
using bench::device_mem;
using bench::time_runs;
using bench::timing;

// Uniform [0, 1) in parallel (independent streams per chunk), as the given 16-bit type.
void fill_uniform16(host_tensor& t, std::uint64_t seed) {
  const std::int64_t n = t.numel(), chunk = 1 << 16;
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    rng r(seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(c));
    for (std::int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) t.set(i, r.uniform());
  }
}

struct accuracy {
  double max_rel_error = 0;
  bool all_finite = true;
};

// Compares sampled rows of `out` (f32, [rows, heads, dim]) with float64 attention on the same set.
accuracy check_rows(const csr_graph& g, const host_tensor& q, const host_tensor& k,
                    const host_tensor& v, const host_tensor& out, std::uint64_t seed) {
  std::vector<std::int64_t> rows;
  rng r(seed);
  for (int i = 0; i < 256 && g.rows > 0; ++i)
    rows.push_back(static_cast<std::int64_t>(r.below(g.rows)));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const csr_graph sub = select_rows(g, rows);
  const std::int64_t w = q.heads() * q.dim();
  host_tensor qs(q.type(), sub.rows, q.heads(), q.dim()),
      ref(dtype::f64, sub.rows, q.heads(), q.dim());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t e = 0; e < w; ++e)
      qs.set(static_cast<std::int64_t>(i) * w + e, q.get(rows[i] * w + e));
  }
  reference::attention(sub, qs.view(), k.view(), v.view(), ref.view(), 1.0);
  accuracy a;
  double max_abs = 0, max_ref = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i)
    a.all_finite = a.all_finite && std::isfinite(out.get(i));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t e = 0; e < w; ++e) {
      const double o = out.get(rows[i] * w + e), rf = ref.get(static_cast<std::int64_t>(i) * w + e);
      max_abs = std::max(max_abs, std::abs(o - rf));
      max_ref = std::max(max_ref, std::abs(rf));
    }
  }
  a.max_rel_error = max_abs / std::max(max_ref, 1e-300);
  return a;
}

struct settings {
  std::int64_t dim = 128, heads = 1;
  int repeat = 20;
  dtype in = dtype::f16;
  bool baselines = true;
  bool training = false;
  bool f32_dout = false;  // the training step's out and dout in f32, not the inputs' dtype
  row_order order = row_order::automatic;          // the plans' windows (forward and backward)
  head_order heads_order = head_order::automatic;  // the (window, head) tasks' order
  double dense_budget_gib = 16;
};

// Largest nnz x heads x dim whose backward the benchmark checks against the float64 reference in
// full; larger graphs are checked for finite, written (unpoisoned) gradients only.
constexpr double kFullGradientCheck = 4e8;

// Max |got - ref| / max |ref| over one gradient tensor.
double relative_error(const host_tensor& got, const host_tensor& ref) {
  double max_abs = 0, max_ref = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    max_abs = std::max(max_abs, std::abs(got.get(i) - ref.get(i)));
    max_ref = std::max(max_ref, std::abs(ref.get(i)));
  }
  return max_abs / std::max(max_ref, 1e-300);
}

void bench_graph(const std::string& name, const csr_graph& g, const settings& cfg,
                 std::int32_t split, std::int32_t team, bool with_baselines) {
  const std::int64_t dim = cfg.dim, heads = cfg.heads;
  const dtype in = cfg.in;
  const int repeat = cfg.repeat;
  const auto t0 = std::chrono::steady_clock::now();
  const attention_plan plan = attention_plan::build(g, device_kind::cuda,
                                                    {.split_tcbs = split,
                                                     .team_tcbs = team,
                                                     .order = cfg.order,
                                                     .heads = cfg.heads_order,
                                                     .workspace_heads = cfg.heads,
                                                     .workspace_dim = cfg.dim});
  check(cudaDeviceSynchronize(), "plan");
  const double build_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The same plan from the pattern already on the device (validation, BSB, work list; the build
  // is synchronous): median of 5.
  double device_build_ms = 0;
  {
    device_mem row_ptr(g.row_ptr.size() * 8), col_idx(g.col_idx.size() * 4);
    check(cudaMemcpy(row_ptr.p, g.row_ptr.data(), g.row_ptr.size() * 8, cudaMemcpyHostToDevice),
          "upload");
    check(cudaMemcpy(col_idx.p, g.col_idx.data(), g.col_idx.size() * 4, cudaMemcpyHostToDevice),
          "upload");
    const csr_view view{.rows = g.rows,
                        .cols = g.cols,
                        .nnz = g.nnz(),
                        .row_ptr = static_cast<const std::int64_t*>(row_ptr.p),
                        .col_idx = static_cast<const std::int32_t*>(col_idx.p)};
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      const auto t1 = std::chrono::steady_clock::now();
      const attention_plan p = attention_plan::build(view, {.split_tcbs = split,
                                                            .team_tcbs = team,
                                                            .workspace_heads = cfg.heads,
                                                            .workspace_dim = cfg.dim});
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count());
    }
    std::sort(ms.begin(), ms.end());
    device_build_ms = ms[ms.size() / 2];
  }

  const std::size_t set_bytes = static_cast<std::size_t>(g.rows + 2 * g.cols) * heads * dim * 2;
  const int sets = static_cast<int>(
      std::clamp<std::size_t>((200u << 20) / std::max<std::size_t>(set_bytes, 1) + 1, 2, 8));
  std::vector<host_tensor> hq, hk, hv;
  std::vector<std::unique_ptr<device_mem>> dq, dk, dv;
  const auto now =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int s = 0; s < sets; ++s) {
    hq.emplace_back(in, g.rows, heads, dim);
    hk.emplace_back(in, g.cols, heads, dim);
    hv.emplace_back(in, g.cols, heads, dim);
    fill_uniform16(hq.back(), now + 3 * s);
    fill_uniform16(hk.back(), now + 3 * s + 1);
    fill_uniform16(hv.back(), now + 3 * s + 2);
    for (auto* pair : {&hq, &hk, &hv}) {
      auto& list = pair == &hq ? dq : pair == &hk ? dk : dv;
      list.push_back(std::make_unique<device_mem>(pair->back().size_bytes()));
      check(cudaMemcpy(list.back()->p, pair->back().data(), pair->back().size_bytes(),
                       cudaMemcpyHostToDevice),
            "upload");
    }
  }
  host_tensor hout(dtype::f32, g.rows, heads, dim);
  device_mem dout(hout.size_bytes());
  const auto view = [&](const host_tensor& h, void* d) {
    tensor_view v = h.view();
    v.data = d;
    v.where = device_kind::cuda;
    return v;
  };
  const tensor_view out_view = view(hout, dout.p);
  const int last = (repeat - 1) % sets;
  // Poisons the output, runs the last timed set once more and checks it against float64.
  const auto verify = [&](const std::function<void(int)>& run) {
    check(cudaMemset(dout.p, 0xFF, hout.size_bytes()), "poison");
    run(last);
    check(cudaMemcpy(hout.data(), dout.p, hout.size_bytes(), cudaMemcpyDeviceToHost), "download");
    return check_rows(g, hq[last], hk[last], hv[last], hout, now);
  };
  const attention_options opts{.scale = 1.0};
  const std::function<void(int)> run = [&](int s) {
    plan.run(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p), out_view, opts);
  };
  const timing kernel = time_runs(repeat, sets, true, run);
  const timing call = time_runs(repeat, sets, false, run);
  const accuracy acc = verify(run);

  const double nnz = static_cast<double>(g.nnz()), hd = static_cast<double>(heads * dim);
  const double bytes = 2 * hd * static_cast<double>(g.rows + 2 * g.cols) +
                       4 * hd * static_cast<double>(g.rows) +
                       static_cast<double>(plan.report().format_bytes);
  const double med = kernel.median;
  nlohmann::json j{{"graph", name},
                   {"rows", g.rows},
                   {"nnz", g.nnz()},
                   {"dim", dim},
                   {"heads", heads},
                   {"dtype", to_string(in)},
                   {"kernel_ms", med},
                   {"kernel_ms_min", kernel.min},
                   {"kernel_ms_max", kernel.max},
                   {"call_ms", call.median},
                   {"build_ms", build_ms},
                   {"device_build_ms", device_build_ms},
                   {"gflops", 4 * nnz * hd / med * 1e-6},
                   {"compulsory_gbps", bytes / med * 1e-6},
                   {"input_sets", sets},
                   {"split_tcbs", split},
                   {"team_tcbs", team},
                   {"format", plan.report().format},
                   {"order", to_string(cfg.order)},
                   {"head_order", to_string(cfg.heads_order)},
                   {"max_rel_error", acc.max_rel_error},
                   {"all_finite", acc.all_finite}};
  if (cfg.training) {
    // Training: a plan with gradients (its build includes the transposed pattern), the forward
    // writing the log-sum-exp, and the backward from it (dq, dk, dv in the input dtype; out and
    // dout in it too, as autograd hands them over, or in f32 with --f32-dout).
    const auto tg = std::chrono::steady_clock::now();
    const attention_plan gp = attention_plan::build(g, device_kind::cuda,
                                                    {.split_tcbs = split,
                                                     .team_tcbs = team,
                                                     .order = cfg.order,
                                                     .heads = cfg.heads_order,
                                                     .workspace_heads = heads,
                                                     .workspace_dim = dim,
                                                     .gradients = true});
    check(cudaDeviceSynchronize(), "plan");
    const double grad_build_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tg).count();
    const dtype grad_out = cfg.f32_dout ? dtype::f32 : in;
    host_tensor hlse(dtype::f32, g.rows, heads, 1), hdout(grad_out, g.rows, heads, dim),
        hto(grad_out, g.rows, heads, dim);
    hdout.fill_uniform(-1.0, 1.0, now + 101);
    host_tensor hdq(in, g.rows, heads, dim), hdk(in, g.cols, heads, dim),
        hdv(in, g.cols, heads, dim);
    device_mem dlse(hlse.size_bytes()), ddout(hdout.size_bytes()), dto(hto.size_bytes()),
        ddq(hdq.size_bytes()), ddk(hdk.size_bytes()), ddv(hdv.size_bytes());
    const tensor_view train_out = view(hto, dto.p);
    check(cudaMemcpy(ddout.p, hdout.data(), hdout.size_bytes(), cudaMemcpyHostToDevice), "upload");
    const attention_options with_lse{.scale = 1.0, .lse = view(hlse, dlse.p)};
    const std::function<void(int)> forward = [&](int s) {
      gp.run(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p), train_out,
             with_lse);
    };
    const std::function<void(int)> backward = [&](int s) {
      gp.backward(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p), train_out,
                  view(hlse, dlse.p), view(hdout, ddout.p), view(hdq, ddq.p), view(hdk, ddk.p),
                  view(hdv, ddv.p), opts);
    };
    const std::function<void(int)> step = [&](int s) {
      forward(s);
      backward(s);
    };
    const timing fwd = time_runs(repeat, sets, true, forward);
    const timing bwd = time_runs(repeat, sets, true, backward);
    const timing both = time_runs(repeat, sets, true, step);
    // Poisoned gradients, one more step on the last set, then the check.
    const std::pair<host_tensor*, device_mem*> grads[] = {{&hdq, &ddq}, {&hdk, &ddk}, {&hdv, &ddv}};
    for (const auto& [h, d] : grads) check(cudaMemset(d->p, 0xFF, h->size_bytes()), "poison");
    step(last);
    for (const auto& [h, d] : grads)
      check(cudaMemcpy(h->data(), d->p, h->size_bytes(), cudaMemcpyDeviceToHost), "download");
    bool finite = true;
    for (const auto* h : {&hdq, &hdk, &hdv})
      for (std::int64_t i = 0; i < h->numel(); ++i) finite = finite && std::isfinite(h->get(i));
    nlohmann::json t{{"grad_build_ms", grad_build_ms},
                     {"forward_lse_ms", fwd.median},
                     {"backward_ms", bwd.median},
                     {"step_ms", both.median},
                     {"backward_gflops", 10 * nnz * hd / bwd.median * 1e-6},
                     {"backward_workspace_bytes", gp.backward_workspace_bytes(heads, dim, in)},
                     {"dout_dtype", std::string(to_string(grad_out))},
                     {"grads_finite", finite}};
    if (nnz * hd <= kFullGradientCheck) {
      host_tensor rq(dtype::f64, g.rows, heads, dim), rk(dtype::f64, g.cols, heads, dim),
          rv(dtype::f64, g.cols, heads, dim);
      reference::attention_backward(g, hq[last].view(), hk[last].view(), hv[last].view(),
                                    hdout.view(), rq.view(), rk.view(), rv.view(), 1.0);
      t["dq_rel_error"] = relative_error(hdq, rq);
      t["dk_rel_error"] = relative_error(hdk, rk);
      t["dv_rel_error"] = relative_error(hdv, rv);
    }
    j["training"] = t;
  }
  if (with_baselines && in == dtype::f16) {
    nlohmann::json base;
    for (const bool fp32 : {true, false}) {
      const std::string key = fp32 ? "cusparse_fp32" : "cusparse_fp16";
      try {
        bench::cusparse_pipeline p(g, heads, dim, fp32);
        for (int s = 0; s < sets; ++s)
          p.add_inputs(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p));
        const std::function<void(int)> r = [&](int s) { p.run(s, out_view); };
        const timing t = time_runs(repeat, sets, true, r);
        const accuracy a = verify(r);
        base[key] = {{"ms", t.median},
                     {"variant", p.describe()},
                     {"max_rel_error", a.max_rel_error},
                     {"all_finite", a.all_finite}};
      } catch (const std::exception& e) {
        base[key] = {{"skipped", e.what()}};
      }
    }
    {  // Our unfused pipeline (ME-BCRS SDDMM -> softmax -> SpMM), its own plan and build time.
      const auto tu = std::chrono::steady_clock::now();
      const attention_plan u = attention_plan::build(
          g, device_kind::cuda,
          {.algo = algorithm::unfused, .workspace_heads = cfg.heads, .workspace_dim = cfg.dim});
      const double u_build =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tu).count();
      const std::function<void(int)> r = [&](int s) {
        u.run(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p), out_view, opts);
      };
      const timing t = time_runs(repeat, sets, true, r);
      const accuracy a = verify(r);
      base["ours_unfused"] = {{"ms", t.median},
                              {"build_ms", u_build},
                              {"format", u.report().format},
                              {"max_rel_error", a.max_rel_error},
                              {"all_finite", a.all_finite}};
    }
    const std::size_t need = bench::dense_masked::bytes_needed(g);
    if (static_cast<double>(need) <= cfg.dense_budget_gib * (1ull << 30)) {
      bench::dense_masked p(g, heads, dim);
      for (int s = 0; s < sets; ++s)
        p.add_inputs(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p));
      const std::function<void(int)> r = [&](int s) { p.run(s, out_view); };
      const timing t = time_runs(repeat, sets, true, r);
      const accuracy a = verify(r);
      base["dense_cublas"] = {
          {"ms", t.median}, {"max_rel_error", a.max_rel_error}, {"all_finite", a.all_finite}};
    } else {
      base["dense_cublas"] = {{"skipped", "needs " + std::to_string(need >> 20) + " MiB"}};
    }
    j["baselines"] = base;
  }
  std::cout << j.dump() << std::endl;
}

// Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer, median
// of 10.
double copy_bandwidth_gbps() {
  const std::size_t bytes = std::size_t{1} << 30;
  device_mem a(bytes), b(bytes);
  check(cudaMemset(a.p, 1, bytes), "memset");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    check(cudaEventRecord(start), "record");
    check(cudaMemcpy(b.p, a.p, bytes, cudaMemcpyDeviceToDevice), "copy");
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return 2.0 * static_cast<double>(bytes) / ms[ms.size() / 2] * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  std::vector<std::int32_t> splits{0}, teams{0};
  std::vector<std::string> paths, rmats, ers, batches;
  std::string dtype_name = "f16", order_name = "automatic", head_order_name = "automatic";
  CLI::App app{"GPU fused 3S benchmark"};
  app.add_option("graphs", paths, "graph files");
  app.add_option("--dim", cfg.dim, "head dimension")->capture_default_str();
  app.add_option("--heads", cfg.heads, "heads")->capture_default_str();
  app.add_option("--repeat", cfg.repeat, "timed runs")->capture_default_str();
  app.add_option("--dtype", dtype_name, "f16 or bf16")->capture_default_str();
  app.add_option("--split", splits, "split thresholds to sweep, comma-separated (0 = cost model)")
      ->delimiter(',')
      ->allow_extra_args(false);
  app.add_option("--team", teams,
                 "team thresholds to sweep, comma-separated (0 = the plan's rule, negative = none)")
      ->delimiter(',')
      ->allow_extra_args(false);
  app.add_option("--rmat", rmats, "generated R-MAT graphs SCALE:EDGE_FACTOR (after the files)");
  app.add_option("--er", ers, "generated Erdos-Renyi graphs NODES:AVG_DEGREE (after the R-MATs)");
  app.add_option("--batch", batches,
                 "generated batches of small graphs GRAPHS:MIN_NODES:MAX_NODES (after the rest)");
  app.add_flag("--baselines,!--no-baselines", cfg.baselines,
               "time the cuSPARSE pipeline and dense cuBLAS attention too (f16 inputs)")
      ->capture_default_str();
  app.add_flag("--training", cfg.training,
               "also time the forward writing the log-sum-exp, the backward and both");
  app.add_flag("--f32-dout", cfg.f32_dout,
               "the training step's out and dout in f32 (default: the inputs' dtype, as autograd "
               "gives them)");
  app.add_option("--order", order_name,
                 "the plans' row order from a host pattern: automatic, original, rcm or clustered")
      ->capture_default_str();
  app.add_option("--head-order", head_order_name,
                 "the kernels' (window, head) task order: automatic, by_window or by_head")
      ->capture_default_str();
  app.add_option("--dense-budget-gib", cfg.dense_budget_gib,
                 "largest rows x cols score matrices the dense baseline allocates")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  for (const auto& r : rmats) paths.push_back("rmat" + r);
  for (const auto& r : ers) paths.push_back("er" + r);
  for (const auto& b : batches) paths.push_back("batch" + b);
  try {
    cfg.in = parse_dtype(dtype_name);
    cfg.order = parse_row_order(order_name);
    cfg.heads_order = parse_head_order(head_order_name);
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "properties");
    std::cout << nlohmann::json{{"device", prop.name},
                                {"sms", prop.multiProcessorCount},
                                {"copy_bandwidth_gbps", copy_bandwidth_gbps()}}
                     .dump()
              << std::endl;
    for (const auto& p : paths) {
      const auto [name, g] = bench::load_graph(p);
      for (const auto split : splits) {
        for (const auto team : teams) {
          bench_graph(name, g, cfg, split, team,
                      cfg.baselines && split == splits.front() && team == teams.front());
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fused3s: %s\n", e.what());
    return 1;
  }
  return 0;
}
