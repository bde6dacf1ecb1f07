// GCN and AGNN layer forward times on the GPU (bench/python/pyg_layers.py times PyG's GCNConv and
// AGNNConv on the same graphs). Per graph: layer build time; GCN (x [N, F_in] w [F_in, F_out])
// and AGNN (h [N, F]) forward in f16 (fp32 out) and f32 (tf32), medians of event-timed calls
// over rotating input sets; each output checked against the float64 CPU layer (max relative
// error). With --fused IN:OUT ...: the fused GCN layer (relu(Â x w + b) and its mask) in both
// orders, the fused kernel and x w + SpMM + epilogue, per width pair and dtype, and the order the
// rule picks. With --gat H:C ...: the fused GAT attention (H heads of C channels, f32; attention
// dropout's factors in a shuffled edge order as PyG draws them, none, or drawn in the kernels),
// forward and backward, each checked against the float64 CPU plan. --only picks sections (layers,
// fused, gat). One JSON object per line.
//   bench_layers [--in 128] [--out 128] [--agnn 128] [--fused 64:128 ...] [--gat 8:8 ...]
//                [--only layers,fused,gat] [--repeat R] GRAPH...
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "common.hpp"

namespace {

using namespace trisparse;
using bench::check;

struct settings {
  std::int64_t in = 128, out = 128, agnn = 128;
  int repeat = 20;
  std::vector<std::string> fused;  // IN:OUT width pairs of the fused GCN layer
  std::vector<std::string> gat;    // H:C head layouts of the fused GAT attention
  std::vector<std::string> only{"layers", "fused", "gat"};
  bool runs(const char* section) const {
    return std::find(only.begin(), only.end(), section) != only.end();
  }
};

std::pair<std::int64_t, std::int64_t> pair_of(const std::string& spec) {
  const auto colon = spec.find(':');
  return {std::stoll(spec.substr(0, colon)), std::stoll(spec.substr(colon + 1))};
}

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

// max |got - want| / max |want| of a device f32 tensor against a host f64 one of the same shape.
double relative_error(const void* got_d, const host_tensor& want) {
  host_tensor got(dtype::f32, want.rows(), want.heads(), want.dim());
  check(cudaMemcpy(got.data(), got_d, got.size_bytes(), cudaMemcpyDeviceToHost), "download");
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
    const auto [fi, fo] = pair_of(spec);
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
        j[name + "_error"] = relative_error(out.p, want);
      }
    }
  }
}

// A host tensor of `rows` x heads x dim f32 values and its device copy.
struct gat_input {
  host_tensor host;
  bench::device_mem mem;
  gat_input(std::int64_t rows, std::int64_t heads, std::int64_t dim)
      : host(dtype::f32, rows, heads, dim), mem(host.size_bytes()) {}
  void upload() {
    check(cudaMemcpy(mem.p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  tensor_view device() const {
    return tensor_view::contiguous(mem.p, dtype::f32, host.rows(), host.heads(), host.dim(),
                                   device_kind::cuda);
  }
};

// The fused GAT attention per head layout, forward (out, lse) and backward (dx, da_src, da_dst)
// in f32, three ways: keep = 0 or 2.5 (dropout 0.6) in rows keep_index[e], a shuffled order (keys
// "gat_HxC_forward_ms", ...); no dropout ("gat_HxC_plain_..."); dropout 0.6 drawn in the kernels,
// keyed by the same shuffled input edges ("gat_HxC_drawn_..."). Outputs poisoned, then checked
// against the float64 CPU plan given the same factors or draws.
void bench_gat(const csr_graph& g, const settings& cfg, nlohmann::json& j) {
  const gat_plan plan = gat_plan::build(g, device_kind::cuda);
  const gat_plan cpu = gat_plan::build(g);
  const std::int64_t nnz = g.nnz();
  std::vector<std::int64_t> index(static_cast<std::size_t>(nnz));
  std::iota(index.begin(), index.end(), std::int64_t{0});
  std::shuffle(index.begin(), index.end(), std::mt19937_64(7));
  bench::device_mem index_d(index.size() * 8);
  check(cudaMemcpy(index_d.p, index.data(), index.size() * 8, cudaMemcpyHostToDevice), "upload");
  const auto* keep_index = static_cast<const std::int64_t*>(index_d.p);
  const std::uint64_t state[2] = {0x5DEECE66Dull, 11};  // attention dropout's {seed, offset}
  bench::device_mem state_d(sizeof state);
  check(cudaMemcpy(state_d.p, state, sizeof state, cudaMemcpyHostToDevice), "upload");
  const attention_dropout drawn{0.6, static_cast<const std::uint64_t*>(state_d.p)},
      drawn_host{0.6, state};
  for (const std::string& spec : cfg.gat) {
    const auto [H, C] = pair_of(spec);
    gat_input x(g.cols, H, C), src(g.cols, H, 1), dst(g.rows, H, 1), keep(nnz, H, 1),
        dout(g.rows, H, C), out(g.rows, H, C), lse(g.rows, H, 1), dx(g.cols, H, C),
        dsrc(g.cols, H, 1), ddst(g.rows, H, 1);
    x.host.fill_uniform(-1, 1, 60);
    src.host.fill_uniform(-3, 3, 61);
    dst.host.fill_uniform(-3, 3, 62);
    dout.host.fill_uniform(-1, 1, 63);
    keep.host.fill_uniform(0, 1, 64);
    for (std::int64_t i = 0; i < keep.host.numel(); ++i)
      keep.host.set(i, keep.host.get(i) < 0.6 ? 0.0 : 2.5);
    for (gat_input* t : {&x, &src, &dst, &keep, &dout}) t->upload();
    // The CPU plan reads keep in entry order: keep's rows gathered through the index.
    host_tensor keep_e(dtype::f32, nnz, H, 1);
    for (std::int64_t e = 0; e < nnz; ++e)
      for (std::int64_t h = 0; h < H; ++h) keep_e.set(e * H + h, keep.host.get(index[e] * H + h));
    const std::size_t fbytes = plan.forward_workspace_bytes(H, C),
                      bbytes = plan.backward_workspace_bytes(H, C);
    bench::device_mem fws(fbytes), bws(bbytes);
    const std::string key = "gat_" + std::to_string(H) + "x" + std::to_string(C);
    // One way of dropping: GPU keep factors (or none) and draws, and the CPU plan's.
    struct way {
      std::string name;
      tensor_view keep, cpu_keep;
      const std::int64_t* index;
      const std::int64_t* cpu_index;
      attention_dropout dropout, cpu_dropout;
    };
    const way ways[] = {
        {"", keep.device(), keep_e.view(), keep_index, nullptr, {}, {}},
        {"_plain", {}, {}, nullptr, nullptr, {}, {}},
        {"_drawn", {}, {}, keep_index, index.data(), drawn, drawn_host},
    };
    for (const way& w : ways) {
      const gat_args args{.x = x.device(),
                          .a_src = src.device(),
                          .a_dst = dst.device(),
                          .keep = w.keep,
                          .keep_index = w.index,
                          .out = out.device(),
                          .lse = lse.device(),
                          .dropout = w.dropout};
      const gat_grad_args grad{.x = x.device(),
                               .a_src = src.device(),
                               .a_dst = dst.device(),
                               .keep = w.keep,
                               .keep_index = w.index,
                               .dropout = w.dropout,
                               .out = out.device(),
                               .lse = lse.device(),
                               .dout = dout.device(),
                               .dx = dx.device(),
                               .da_src = dsrc.device(),
                               .da_dst = ddst.device()};
      const auto forward = [&](int) { plan.forward(args, {}, {fws.p, fbytes}); };
      const auto backward = [&](int) { plan.backward(grad, {}, {bws.p, bbytes}); };
      for (gat_input* t : {&out, &lse, &dx, &dsrc, &ddst})
        check(cudaMemset(t->mem.p, 0xFF, t->host.size_bytes()), "poison");
      forward(0);
      backward(0);
      host_tensor out_w(dtype::f64, g.rows, H, C), lse_w(dtype::f64, g.rows, H, 1),
          dx_w(dtype::f64, g.cols, H, C), dsrc_w(dtype::f64, g.cols, H, 1),
          ddst_w(dtype::f64, g.rows, H, 1);
      cpu.forward({.x = x.host.view(),
                   .a_src = src.host.view(),
                   .a_dst = dst.host.view(),
                   .keep = w.cpu_keep,
                   .keep_index = w.cpu_index,
                   .out = out_w.view(),
                   .lse = lse_w.view(),
                   .dropout = w.cpu_dropout});
      cpu.backward({.x = x.host.view(),
                    .a_src = src.host.view(),
                    .a_dst = dst.host.view(),
                    .keep = w.cpu_keep,
                    .keep_index = w.cpu_index,
                    .dropout = w.cpu_dropout,
                    .out = out_w.view(),
                    .lse = lse_w.view(),
                    .dout = dout.host.view(),
                    .dx = dx_w.view(),
                    .da_src = dsrc_w.view(),
                    .da_dst = ddst_w.view()});
      j[key + w.name + "_forward_ms"] = bench::time_runs(cfg.repeat, 1, false, forward).median;
      j[key + w.name + "_backward_ms"] = bench::time_runs(cfg.repeat, 1, false, backward).median;
      j[key + w.name + "_error"] =
          std::max({relative_error(out.mem.p, out_w), relative_error(dx.mem.p, dx_w),
                    relative_error(dsrc.mem.p, dsrc_w), relative_error(ddst.mem.p, ddst_w)});
    }
  }
}

void bench_graph(const std::string& name, const csr_graph& g, const settings& cfg) {
  nlohmann::json j{{"graph", name}, {"rows", g.rows}, {"nnz", g.nnz()}};
  if (cfg.runs("fused") && !cfg.fused.empty()) bench_fused(g, cfg, j);
  if (cfg.runs("gat") && !cfg.gat.empty()) bench_gat(g, cfg, j);
  if (!cfg.runs("layers")) {
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
  j.update({{"in", cfg.in},
            {"out", cfg.out},
            {"agnn_dim", cfg.agnn},
            {"gcn_build_ms", gcn_build},
            {"agnn_build_ms", agnn_build}});
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
    j["gcn_" + key + "_error"] = relative_error(out.p, want);
    host_tensor want_h(dtype::f64, g.rows, 1, cfg.agnn);
    check(cudaMemset(out.p, 0xFF, static_cast<std::size_t>(g.rows * width) * 4), "poison");
    run_agnn(0);
    agnn_cpu.forward(hs[0]->host.view(), 1.0, want_h.view());
    j["agnn_" + key + "_error"] = relative_error(out.p, want_h);
  }
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  std::vector<std::string> paths;
  CLI::App app{"GCN, AGNN, fused GCN and fused GAT layers on the GPU"};
  app.add_option("graphs", paths, "graph files or generated specs (rmatS:EF, erN:DEG)");
  app.add_option("--in", cfg.in, "GCN input width")->capture_default_str();
  app.add_option("--out", cfg.out, "GCN output width")->capture_default_str();
  app.add_option("--agnn", cfg.agnn, "AGNN width")->capture_default_str();
  app.add_option("--repeat", cfg.repeat, "timed runs")->capture_default_str();
  app.add_option("--fused", cfg.fused, "fused GCN layer width pairs IN:OUT");
  app.add_option("--gat", cfg.gat, "fused GAT attention head layouts H:C");
  app.add_option("--only", cfg.only, "sections: layers, fused, gat")
      ->delimiter(',')
      ->check(CLI::IsMember({"layers", "fused", "gat"}));
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
