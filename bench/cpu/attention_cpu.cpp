// CPU sparse attention benchmark: the fused fp32 engine and the float64 reference on real graphs,
// median of event-free wall-clock runs over rotating input buffers, with the machine's measured
// copy bandwidth for comparison. Prints one JSON object per graph.
//   bench_attention_cpu [--dim D] [--heads H] [--repeat R] GRAPH...
#include <omp.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trisparse/trisparse.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

template <class F>
double median_seconds(int repeat, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = clock_type::now();
    f(i);
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Copy bandwidth (read + write bytes per second) of a 1 GiB buffer with all threads.
double copy_bandwidth() {
  const std::size_t n = std::size_t{1} << 27;  // doubles: 1 GiB per buffer
  std::vector<double> a(n, 1.0), b(n, 0.0);
  const double s = median_seconds(5, [&](int) {
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < n; ++i) b[i] = a[i];
  });
  return 2.0 * static_cast<double>(n) * sizeof(double) / s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace trisparse;
  std::int64_t dim = 128, heads = 1;
  int repeat = 10;
  std::vector<std::string> graphs;
  CLI::App app{"CPU sparse attention benchmark: cpu_fused and the float64 reference"};
  app.add_option("graphs", graphs, "graph files")->required();
  app.add_option("--dim", dim, "head dimension")->capture_default_str();
  app.add_option("--heads", heads, "heads")->capture_default_str();
  app.add_option("--repeat", repeat, "timed runs")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const double copy_bw = copy_bandwidth();
  std::printf("{\"copy_bandwidth_gbps\": %.2f, \"threads\": %d}\n", copy_bw * 1e-9,
              omp_get_max_threads());
  for (const auto& path : graphs) {
    const csr_graph g = read_graph(path);
    // Two input sets, alternated, so no timed run finds the previous run's operands in cache.
    // fp32 uniform in [0, 1), no scale: the anchors' setting.
    std::vector<host_tensor> q, k, v;
    for (std::uint64_t s = 0; s < 2; ++s) {
      const std::uint64_t seed =
          static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count()) + 10 * s;
      q.emplace_back(dtype::f32, g.rows, heads, dim);
      k.emplace_back(dtype::f32, g.cols, heads, dim);
      v.emplace_back(dtype::f32, g.cols, heads, dim);
      q.back().fill_uniform(0, 1, seed);
      k.back().fill_uniform(0, 1, seed + 1);
      v.back().fill_uniform(0, 1, seed + 2);
    }
    host_tensor out(dtype::f32, g.rows, heads, dim), ref(dtype::f64, g.rows, heads, dim);
    const auto t_plan = clock_type::now();
    const attention_plan plan = attention_plan::build(g);
    const double plan_s = seconds_since(t_plan);
    const attention_options opts{.scale = 1.0};
    plan.run(q[0].view(), k[0].view(), v[0].view(), out.view(), opts);  // warm-up
    const double fused_s = median_seconds(repeat, [&](int i) {
      plan.run(q[i % 2].view(), k[i % 2].view(), v[i % 2].view(), out.view(), opts);
    });
    // The output of the last run (input set (repeat - 1) % 2) against the float64 reference.
    const int last = (repeat - 1) % 2;
    const double ref_s = median_seconds(3, [&](int) {
      reference::attention(g, q[last].view(), k[last].view(), v[last].view(), ref.view(), 1.0);
    });
    double max_abs = 0, max_ref = 0;
    for (std::int64_t i = 0; i < ref.numel(); ++i) {
      max_abs = std::max(max_abs, std::abs(out.get(i) - ref.get(i)));
      max_ref = std::max(max_ref, std::abs(ref.get(i)));
    }
    const double hd = static_cast<double>(heads * dim), nnz = static_cast<double>(g.nnz());
    const double flops = 4.0 * nnz * hd;
    // Compulsory bytes: Q, K, V read once, O written once, the CSR read once.
    const double compulsory = 4.0 * hd * static_cast<double>(g.rows + 2 * g.cols + g.rows) +
                              8.0 * static_cast<double>(g.rows + 1) + 4.0 * nnz;
    // Gather bytes: a K and a V row per edge (what a cache-less kernel moves).
    const double gathered =
        8.0 * hd * nnz + 4.0 * hd * static_cast<double>(2 * g.rows) + 12.0 * nnz;
    nlohmann::json j{{"graph", path},
                     {"rows", g.rows},
                     {"nnz", g.nnz()},
                     {"heads", heads},
                     {"dim", dim},
                     {"plan_build_ms", plan_s * 1e3},
                     {"fused_ms", fused_s * 1e3},
                     {"fused_gflops", flops / fused_s * 1e-9},
                     {"fused_compulsory_gbps", compulsory / fused_s * 1e-9},
                     {"fused_gather_gbps", gathered / fused_s * 1e-9},
                     {"reference_f64_ms", ref_s * 1e3},
                     {"reference_gflops", flops / ref_s * 1e-9},
                     {"max_rel_error_vs_f64", max_abs / std::max(max_ref, 1e-300)}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}
