// GCN and AGNN layer forward times on the GPU (bench/python/pyg_layers.py times PyG's GCNConv and
// AGNNConv on the same graphs). Per graph: layer build time; GCN (x [N, F_in] w [F_in, F_out])
// and AGNN (h [N, F]) forward in f16 (fp32 out) and f32 (tf32), medians of event-timed calls
// over rotating input sets; each output checked against the float64 CPU layer (max relative
// error). With --fused IN:OUT ...: the fused GCN layer (relu(Â x w + b) and its mask) in both
// orders, the fused kernel and x w + SpMM + epilogue, per width pair and dtype, and the order the
// rule picks. One JSON object per line.
//   bench_layers [--in 128] [--out 128] [--agnn 128] [--fused 64:128 ...] [--fused-only]
//                [--repeat R] GRAPH...
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "common.hpp"

namespace {

using namespace trisparse;
using bench::check;

struct settings {
  std::int64_t in = 128, out = 128, agnn = 128;
  int repeat = 20;
  std::vector<std::string> fused;  // IN:OUT width pairs of the fused GCN layer
  bool fused_only = false;
};

// A host tensor of uniform [-1, 1) values and its device copy.
struct input {
  host_tensor host;
  bench::device_mem mem;
  input(dtype t, std::int64_t rows, std::int64_t dim, std::uint64_t seed, double scale = 1.0)
      : host(t, rows, 1, dim), mem(host.size_bytes()) {
    host.fill_uniform(-scale, scale, seed);
    check(cudaMemcpy(mem.p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  tensor_view view() const {
    return tensor_view::contiguous(mem.p, host.type(), host.rows(), 1, host.dim(),
                                   device_kind::cuda);
  }
};

// max |got - want| / max |want| of a device f32 output against a host f64 one.
double relative_error(const bench::device_mem& got_d, const host_tensor& want) {
  host_tensor got(dtype::f32, want.rows(), 1, want.dim());
  check(cudaMemcpy(got.data(), got_d.p, got.size_bytes(), cudaMemcpyDeviceToHost), "download");
  double err = 0, ref = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    if (!std::isfinite(got.get(i))) return INFINITY;
    err = std::max(err, std::abs(got.get(i) - want.get(i)));
    ref = std::max(ref, std::abs(want.get(i)));
  }
  return err / std::max(ref, 1e-300);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The fused GCN layer on Â = gcn_normalized(g): both orders per width pair and dtype, each
// output (poisoned first) against the float64 CPU plan.
void bench_fused(const csr_graph& g, const settings& cfg, nlohmann::json& j) {
  const csr_graph p = gcn_normalized(g);
  auto t0 = std::chrono::steady_clock::now();
  const gcn_fused_plan plan = gcn_fused_plan::build(p, device_kind::cuda);
  check(cudaDeviceSynchronize(), "build");
  j["fused_build_ms"] = ms_since(t0);
  const gcn_fused_plan cpu = gcn_fused_plan::build(p);
  for (const std::string& spec : cfg.fused) {
    const auto colon = spec.find(':');
    const std::int64_t fi = std::stoll(spec.substr(0, colon)),
                       fo = std::stoll(spec.substr(colon + 1));
    bench::device_mem out(static_cast<std::size_t>(g.rows * fo) * 4),
        mask(static_cast<std::size_t>(g.rows * ((fo + 31) / 32)) * 4 + 4);
    // The float64 reference once per pair, from the f32 draws (the f16 ones are these rounded).
    const input b(dtype::f32, 1, fo, 51, 0.1);
    const input x32(dtype::f32, g.rows, fi, 40), w32(dtype::f32, fi, fo, 50, 1.0 / std::sqrt(fi));
    host_tensor want(dtype::f64, g.rows, 1, fo);
    cpu.forward(
        {.x = x32.host.view(), .w = w32.host.view(), .bias = b.host.view(), .out = want.view()});
    for (const dtype t : {dtype::f16, dtype::f32}) {
      const std::string key = spec + (t == dtype::f16 ? "_f16" : "_tf32");
      std::vector<std::unique_ptr<input>> xs;
      for (int s = 0; s < 2; ++s) xs.push_back(std::make_unique<input>(t, g.rows, fi, 40 + s));
      const input w(t, fi, fo, 50, 1.0 / std::sqrt(static_cast<double>(fi)));
      const tensor_view o =
          tensor_view::contiguous(out.p, dtype::f32, g.rows, 1, fo, device_kind::cuda);
      j["fused_rule_" + key] = plan.fused(fi, fo, t) ? "fused" : "unfused";
      for (const gcn_order order : {gcn_order::fused, gcn_order::unfused}) {
        if (!plan.fused(fi, fo, t, order) && order == gcn_order::fused) continue;
        const std::string name = (order == gcn_order::fused ? "fused_" : "unfused_") + key;
        bench::device_mem ws(plan.workspace_bytes(fi, fo, t, order) + 256);
        const auto run = [&](int s) {
          plan.forward({.x = xs[s]->view(),
                        .w = w.view(),
                        .bias = b.view(),
                        .out = o,
                        .relu_mask = static_cast<std::uint32_t*>(mask.p),
                        .order = order},
                       {}, {ws.p, plan.workspace_bytes(fi, fo, t, order) + 256});
        };
        j[name + "_ms"] = bench::time_runs(cfg.repeat, 2, false, run).median;
        check(cudaMemset(out.p, 0xFF, static_cast<std::size_t>(g.rows * fo) * 4), "poison");
        run(0);
        j[name + "_error"] = relative_error(out, want);
      }
    }
  }
}

void bench_graph(const std::string& name, const csr_graph& g, const settings& cfg) {
  if (cfg.fused_only) {
    nlohmann::json j{{"graph", name}, {"rows", g.rows}, {"nnz", g.nnz()}};
    bench_fused(g, cfg, j);
    std::cout << j.dump() << std::endl;
    return;
  }
  auto t0 = std::chrono::steady_clock::now();
  const gcn_layer gcn = gcn_layer::build(g, device_kind::cuda);
  check(cudaDeviceSynchronize(), "build");
  const double gcn_build = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  const agnn_layer agnn = agnn_layer::build(g, device_kind::cuda);
  check(cudaDeviceSynchronize(), "build");
  const double agnn_build = ms_since(t0);
  nlohmann::json j{{"graph", name},
                   {"rows", g.rows},
                   {"nnz", gcn.nnz()},
                   {"in", cfg.in},
                   {"out", cfg.out},
                   {"agnn_dim", cfg.agnn},
                   {"gcn_build_ms", gcn_build},
                   {"agnn_build_ms", agnn_build}};
  const gcn_layer gcn_cpu = gcn_layer::build(g);
  const agnn_layer agnn_cpu = agnn_layer::build(g);
  const std::int64_t width = std::max(cfg.out, cfg.agnn);
  bench::device_mem out(static_cast<std::size_t>(g.rows * width) * 4);
  const auto out_view = [&](std::int64_t dim) {
    return tensor_view::contiguous(out.p, dtype::f32, g.rows, 1, dim, device_kind::cuda);
  };
  for (const dtype t : {dtype::f16, dtype::f32}) {
    const std::string key = t == dtype::f16 ? "f16" : "tf32";
    std::vector<std::unique_ptr<input>> xs, hs;
    for (int s = 0; s < 2; ++s) {
      xs.push_back(std::make_unique<input>(t, g.rows, cfg.in, 10 + s));
      hs.push_back(std::make_unique<input>(t, g.rows, cfg.agnn, 20 + s));
    }
    const input w(t, cfg.in, cfg.out, 30, 1.0 / std::sqrt(static_cast<double>(cfg.in)));
    const auto run_gcn = [&](int s) { gcn.forward(xs[s]->view(), w.view(), out_view(cfg.out)); };
    const auto run_agnn = [&](int s) { agnn.forward(hs[s]->view(), 1.0, out_view(cfg.agnn)); };
    j["gcn_" + key + "_ms"] = bench::time_runs(cfg.repeat, 2, false, run_gcn).median;
    j["agnn_" + key + "_ms"] = bench::time_runs(cfg.repeat, 2, false, run_agnn).median;
    // Poisoned output, one more call, against the float64 CPU layer.
    host_tensor want(dtype::f64, g.rows, 1, cfg.out);
    check(cudaMemset(out.p, 0xFF, static_cast<std::size_t>(g.rows * width) * 4), "poison");
    run_gcn(0);
    gcn_cpu.forward(xs[0]->host.view(), w.host.view(), want.view());
    j["gcn_" + key + "_error"] = relative_error(out, want);
    host_tensor want_h(dtype::f64, g.rows, 1, cfg.agnn);
    check(cudaMemset(out.p, 0xFF, static_cast<std::size_t>(g.rows * width) * 4), "poison");
    run_agnn(0);
    agnn_cpu.forward(hs[0]->host.view(), 1.0, want_h.view());
    j["agnn_" + key + "_error"] = relative_error(out, want_h);
  }
  if (!cfg.fused.empty()) bench_fused(g, cfg, j);
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  std::vector<std::string> paths;
  CLI::App app{"GCN / AGNN layer forward on the GPU"};
  app.add_option("graphs", paths, "graph files or generated specs (rmatS:EF, erN:DEG)");
  app.add_option("--in", cfg.in, "GCN input width")->capture_default_str();
  app.add_option("--out", cfg.out, "GCN output width")->capture_default_str();
  app.add_option("--agnn", cfg.agnn, "AGNN width")->capture_default_str();
  app.add_option("--repeat", cfg.repeat, "timed runs")->capture_default_str();
  app.add_option("--fused", cfg.fused, "fused GCN layer width pairs IN:OUT");
  app.add_flag("--fused-only", cfg.fused_only, "only the fused GCN layer");
  CLI11_PARSE(app, argc, argv);
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
    std::fprintf(stderr, "bench_layers: %s\n", e.what());
    return 1;
  }
  return 0;
}
