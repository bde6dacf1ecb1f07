// GPU SpMM / SDDMM / softmax benchmark (FlashSparse's kernels over ME-BCRS) against cuSPARSE in the
// same run. Per graph: plan build time, ME-BCRS and SR-BCRS footprints; SpMM at each n (ours f16
// 8x1 and 16x1, ours tf32, cusparseSpMM fp32 and fp16) and SDDMM at each d (the same variants
// against cusparseSDDMM), median of event-timed kernel runs behind a busy-wait, rotating input
// sets; GFLOP/s (2 nnz n); our f16 and tf32 outputs checked against float64 on sampled rows; the
// plan's row order against the original one; the naive and the stable row softmax.
// One JSON object per line.
//   bench_me_bcrs [--n 32,64,128,256] [--d 32,128] [--repeat R] [--rmat S:EF]... [--er N:DEG]...
//                GRAPH...
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "common.hpp"

namespace {

using namespace trisparse;
using bench::check;
using bench::time_runs;

struct settings {
  std::vector<std::int64_t> ns{32, 64, 128, 256}, ds{32, 128};
  int repeat = 20;
  bool baselines = true;
  std::int32_t split = 0;  // sparse_plan_options::split_blocks (0 = the plan's rule)
  std::int32_t team = 0;   // sparse_plan_options::team_blocks (0 = the plan's rule)
};

// A device tensor of uniform [-1, 1) values, with views of any [rows, 1, dim] prefix shape.
struct dense {
  host_tensor host;
  bench::device_mem mem;
  dense(dtype t, std::int64_t rows, std::int64_t dim, std::uint64_t seed)
      : host(t, rows, 1, dim), mem(host.size_bytes()) {
    host.fill_uniform(-1.0, 1.0, seed);
    check(cudaMemcpy(mem.p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  tensor_view view(std::int64_t rows, std::int64_t dim) const {
    return tensor_view::contiguous(mem.p, host.type(), rows, 1, dim, device_kind::cuda);
  }
  // The [rows, 1, dim] tensor view() shows, on the host.
  host_tensor as(std::int64_t rows, std::int64_t dim) const {
    host_tensor t(host.type(), rows, 1, dim);
    std::memcpy(t.data(), host.data(), t.size_bytes());
    return t;
  }
};

std::vector<std::int64_t> sample_rows(const csr_graph& g) {
  std::vector<std::int64_t> rows;
  rng r(5);
  for (int i = 0; i < 200 && g.rows > 0; ++i)
    rows.push_back(static_cast<std::int64_t>(r.below(g.rows)));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// max |c - ref| / max |ref| over sampled rows of c = A b (c: f32 [rows, 1, n] on the device).
double spmm_error(const csr_graph& g, const host_tensor& b, const void* d_c, std::int64_t n) {
  const auto rows = sample_rows(g);
  const csr_graph sub = select_rows(g, rows);
  host_tensor ref(dtype::f64, sub.rows, 1, n), c(dtype::f32, g.rows, 1, n);
  check(cudaMemcpy(c.data(), d_c, c.size_bytes(), cudaMemcpyDeviceToHost), "download");
  reference::spmm(sub, {}, b.view(), ref.view());
  double max_abs = 0, max_ref = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t f = 0; f < n; ++f) {
      const double r = ref.get(static_cast<std::int64_t>(i) * n + f), x = c.get(rows[i] * n + f);
      if (!std::isfinite(x)) return INFINITY;
      max_abs = std::max(max_abs, std::abs(x - r));
      max_ref = std::max(max_ref, std::abs(r));
    }
  }
  return max_abs / std::max(max_ref, 1e-300);
}

double ms_of(const bench::timing& t) { return t.median; }

void bench_graph(const std::string& name, const csr_graph& g, const settings& cfg) {
  // The plans' own workspaces serve the widest SpMM timed.
  const std::int64_t widest =
      std::max<std::int64_t>(256, *std::max_element(cfg.ns.begin(), cfg.ns.end()));
  const auto t0 = std::chrono::steady_clock::now();
  const sparse_plan p8 = sparse_plan::build(g, device_kind::cuda,
                                            {.vector_rows = 8,
                                             .split_blocks = cfg.split,
                                             .team_blocks = cfg.team,
                                             .workspace_dim = widest});
  check(cudaDeviceSynchronize(), "build");
  const double build_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const sparse_plan p16 = sparse_plan::build(g, device_kind::cuda,
                                             {.vector_rows = 16,
                                              .split_blocks = cfg.split,
                                              .team_blocks = cfg.team,
                                              .workspace_dim = widest});
  // SpMM with one warp per work item (no teams), the ablation of team_blocks.
  const sparse_plan p8w =
      sparse_plan::build(g, device_kind::cuda, {.team_blocks = -1, .workspace_dim = widest});
  // The same kernels with the rows as given (the row-order ablation), when the plan reordered.
  const bool reordered = p8.report().order != row_order::original;
  const sparse_plan p8o = reordered ? sparse_plan::build(g, device_kind::cuda,
                                                         {.split_blocks = cfg.split,
                                                          .team_blocks = cfg.team,
                                                          .order = row_order::original,
                                                          .workspace_dim = widest})
                                    : p8;
  const auto& r8 = p8.report();
  nlohmann::json j{{"graph", name},
                   {"split", cfg.split},
                   {"team", cfg.team},
                   {"rows", g.rows},
                   {"cols", g.cols},
                   {"nnz", g.nnz()},
                   {"vectors_8x1", r8.vectors},
                   {"vectors_16x1", p16.report().vectors},
                   {"vectors_8x1_original_order", p8o.report().vectors},
                   {"order", to_string(r8.order)},
                   {"build_ms", build_ms},
                   {"me_bcrs_bytes", r8.format_bytes},
                   {"sr_bcrs_bytes", r8.sr_bcrs_bytes}};
  const std::int64_t max_n = *std::max_element(cfg.ns.begin(), cfg.ns.end());
  const std::int64_t max_d = *std::max_element(cfg.ds.begin(), cfg.ds.end());
  const std::int64_t big = std::max({g.rows, g.cols, std::int64_t{1}});
  // Input sets: enough to exceed the L2 (50 MB) on mid-size graphs, at most 4.
  const int sets = static_cast<int>(std::clamp<std::int64_t>(
      (std::int64_t{100} << 20) / std::max<std::int64_t>(g.cols * max_n * 2, 1), 1, 4));
  std::vector<std::unique_ptr<dense>> b16, b32;
  for (int i = 0; i < sets; ++i) {
    b16.push_back(std::make_unique<dense>(dtype::f16, big, std::max(max_n, max_d), 11 + i));
    b32.push_back(std::make_unique<dense>(dtype::f32, big, std::max(max_n, max_d), 11 + i));
  }
  bench::device_mem c(static_cast<std::size_t>(g.rows) * max_n * 4 + 16);
  const auto c_view = [&](std::int64_t n) {
    return tensor_view::contiguous(c.p, dtype::f32, g.rows, 1, n, device_kind::cuda);
  };
  std::unique_ptr<bench::cusparse_kernels> cs32, cs16;
  nlohmann::json spmm = nlohmann::json::array(), sddmm = nlohmann::json::array();
  for (const std::int64_t n : cfg.ns) {
    nlohmann::json row{{"n", n}};
    const auto ours = [&](const sparse_plan& plan, auto& bufs) {
      return ms_of(time_runs(cfg.repeat, sets, true,
                             [&](int s) { plan.spmm({}, bufs[s]->view(g.cols, n), c_view(n)); }));
    };
    const auto checked = [&](const sparse_plan& plan, const dense& b) {  // poisoned, one run
      check(cudaMemset(c.p, 0xFF, static_cast<std::size_t>(g.rows) * n * 4), "poison");
      plan.spmm({}, b.view(g.cols, n), c_view(n));
      return spmm_error(g, b.as(g.cols, n), c.p, n);
    };
    row["ours_f16_ms"] = ours(p8, b16);
    row["err_f16"] = checked(p8, *b16[0]);
    row["ours_tf32_ms"] = ours(p8, b32);
    row["err_tf32"] = checked(p8, *b32[0]);
    row["ours_f16_16x1_ms"] = ours(p16, b16);
    row["ours_f16_original_order_ms"] =
        reordered ? ours(p8o, b16) : row["ours_f16_ms"].get<double>();
    row["ours_f16_single_warp_ms"] = ours(p8w, b16);
    if (cfg.baselines) {
      try {
        cs32 = std::make_unique<bench::cusparse_kernels>(g, true, n, 32);
        row["cusparse_fp32_ms"] = ms_of(time_runs(cfg.repeat, sets, true, [&](int s) {
          cs32->spmm(b32[s]->mem.p, static_cast<float*>(c.p));
        }));
      } catch (const std::exception& e) {
        row["cusparse_fp32_error"] = e.what();
      }
      try {
        cs16 = std::make_unique<bench::cusparse_kernels>(g, false, n, 32);
        row["cusparse_fp16_ms"] = ms_of(time_runs(cfg.repeat, sets, true, [&](int s) {
          cs16->spmm(b16[s]->mem.p, static_cast<float*>(c.p));
        }));
      } catch (const std::exception& e) {
        row["cusparse_fp16_error"] = e.what();
      }
    }
    row["gflops_f16"] =
        2.0 * static_cast<double>(g.nnz() * n) / (row["ours_f16_ms"].get<double>() * 1e6);
    spmm.push_back(row);
  }
  j["spmm"] = spmm;
  // SDDMM (x = y's first rows: square patterns use the same rows) and the softmax after it.
  bench::device_mem s_out(static_cast<std::size_t>(std::max<std::int64_t>(p8.slots(), 1)) * 4),
      s16_out(static_cast<std::size_t>(std::max<std::int64_t>(p16.slots(), 1)) * 4),
      s_out_original(static_cast<std::size_t>(std::max<std::int64_t>(p8o.slots(), 1)) * 4);
  const auto slots_view = [](const bench::device_mem& m, std::int64_t slots) {
    tensor_view v = tensor_view::contiguous(m.p, dtype::f32, slots, 1, 1, device_kind::cuda);
    return v;
  };
  for (const std::int64_t d : cfg.ds) {
    nlohmann::json row{{"d", d}};
    const auto ours = [&](const sparse_plan& plan, auto& bufs, const bench::device_mem& out) {
      return ms_of(time_runs(cfg.repeat, sets, true, [&](int s) {
        plan.sddmm(bufs[s]->view(g.rows, d), bufs[(s + 1) % sets]->view(g.cols, d),
                   slots_view(out, plan.slots()));
      }));
    };
    row["ours_f16_ms"] = ours(p8, b16, s_out);
    row["ours_tf32_ms"] = ours(p8, b32, s_out);
    row["ours_f16_16x1_ms"] = ours(p16, b16, s16_out);
    row["ours_f16_original_order_ms"] =
        reordered ? ours(p8o, b16, s_out_original) : row["ours_f16_ms"].get<double>();
    if (cfg.baselines) {
      try {
        cs32 = std::make_unique<bench::cusparse_kernels>(g, true, 32, d);
        row["cusparse_fp32_ms"] = ms_of(time_runs(cfg.repeat, sets, true, [&](int s) {
          cs32->sddmm(b32[s]->mem.p, b32[(s + 1) % sets]->mem.p);
        }));
      } catch (const std::exception& e) {
        row["cusparse_fp32_error"] = e.what();
      }
      try {
        cs16 = std::make_unique<bench::cusparse_kernels>(g, false, 32, d);
        row["cusparse_fp16"] = cs16->describe();
        row["cusparse_fp16_ms"] = ms_of(time_runs(cfg.repeat, sets, true, [&](int s) {
          cs16->sddmm(b16[s]->mem.p, b16[(s + 1) % sets]->mem.p);
        }));
      } catch (const std::exception& e) {
        row["cusparse_fp16_error"] = e.what();
      }
    }
    sddmm.push_back(row);
  }
  j["sddmm"] = sddmm;
  j["softmax_ms"] = ms_of(time_runs(cfg.repeat, 1, true, [&](int) {
    p8.softmax(slots_view(s_out, p8.slots()), slots_view(s_out, p8.slots()));
  }));
  // FlashSparse's naive exp / sum softmax against the max-stabilised one, both over the scores in
  // CSR order (one warp per row), and what the naive one gives when scores reach 100.
  {
    bench::csr_softmax csr(g);
    host_tensor scores(dtype::f32, std::max<std::int64_t>(g.nnz(), 1), 1, 1);
    scores.fill_uniform(-100.0, 100.0, 77);
    bench::device_mem in(scores.size_bytes()), out(scores.size_bytes());
    check(cudaMemcpy(in.p, scores.data(), scores.size_bytes(), cudaMemcpyHostToDevice), "upload");
    const auto* pin = static_cast<const float*>(in.p);
    auto* pout = static_cast<float*>(out.p);
    j["csr_softmax_stable_ms"] =
        ms_of(time_runs(cfg.repeat, 1, true, [&](int) { csr.run(pin, pout, true); }));
    j["csr_softmax_naive_ms"] =
        ms_of(time_runs(cfg.repeat, 1, true, [&](int) { csr.run(pin, pout, false); }));
    host_tensor got(dtype::f32, scores.rows(), 1, 1);
    std::int64_t bad = 0;
    check(cudaMemcpy(got.data(), out.p, got.size_bytes(), cudaMemcpyDeviceToHost), "download");
    for (std::int64_t i = 0; i < g.nnz(); ++i) bad += !std::isfinite(got.get(i));
    j["naive_nonfinite_at_100"] = bad;
    // Ours on the same scores (through the slot layout): every value finite.
    const tensor_view entries =
        tensor_view::contiguous(in.p, dtype::f32, g.nnz(), 1, 1, device_kind::cuda);
    p8.to_slots(entries, slots_view(s_out, p8.slots()));
    p8.softmax(slots_view(s_out, p8.slots()), slots_view(s_out, p8.slots()));
    p8.to_entries(slots_view(s_out, p8.slots()),
                  tensor_view::contiguous(out.p, dtype::f32, g.nnz(), 1, 1, device_kind::cuda));
    check(cudaMemcpy(got.data(), out.p, got.size_bytes(), cudaMemcpyDeviceToHost), "download");
    bad = 0;
    for (std::int64_t i = 0; i < g.nnz(); ++i) bad += !std::isfinite(got.get(i));
    j["ours_nonfinite_at_100"] = bad;
  }
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  std::vector<std::string> paths, rmats, ers, matrices;
  CLI::App app{"GPU SpMM / SDDMM benchmark (ME-BCRS) against cuSPARSE"};
  app.add_option("graphs", paths, "graph files");
  app.add_option("--n", cfg.ns, "SpMM widths")->delimiter(',')->allow_extra_args(false);
  app.add_option("--d", cfg.ds, "SDDMM widths")->delimiter(',')->allow_extra_args(false);
  app.add_option("--repeat", cfg.repeat, "timed runs")->capture_default_str();
  app.add_option("--rmat", rmats, "generated R-MAT graphs SCALE:EDGE_FACTOR (after the files)");
  app.add_option("--er", ers, "generated Erdos-Renyi graphs NODES:AVG_DEGREE (after the R-MATs)");
  app.add_option("--matrix", matrices,
                 "generated SuiteSparse-like matrices CLASS:ROWS, CLASS one of fem, circuit, web, "
                 "lp, uniform (after the Erdos-Renyi graphs)");
  app.add_option("--split", cfg.split, "split windows of more blocks than this (0 = plan's rule)")
      ->capture_default_str();
  app.add_option("--team", cfg.team,
                 "SpMM items of at least this many blocks run on a team of warps (0 = plan's "
                 "rule, -1 = never)")
      ->capture_default_str();
  app.add_flag("--baselines,!--no-baselines", cfg.baselines, "time cuSPARSE too")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  for (const auto& r : rmats) paths.push_back("rmat" + r);
  for (const auto& r : ers) paths.push_back("er" + r);
  for (const auto& m : matrices) paths.push_back(m);
  try {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "properties");
    std::cout << nlohmann::json{{"device", prop.name}, {"sms", prop.multiProcessorCount}}.dump()
              << std::endl;
    for (const auto& p : paths) {
      const auto [name, g] = bench::load_graph(p);
      bench_graph(name, g, cfg);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_me_bcrs: %s\n", e.what());
    return 1;
  }
  return 0;
}
