// CPU sparse kernels benchmark: the CPU fast paths (sparse_plan's SpMM, SDDMM and softmax, the GCN
// and AGNN layers) against the float64 oracle (reference::) on real graphs, median wall-clock
// times, the largest error against the oracle. Prints one JSON object per graph.
//   bench_sparse_cpu [--dim D] [--repeat R] GRAPH...
#include <omp.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trisparse/trisparse.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

template <class F>
double median_ms(int repeat, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// max |got - want| / max |want|.
double relative_error(const trisparse::host_tensor& got, const trisparse::host_tensor& want) {
  double err = 0, top = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    err = std::max(err, std::abs(got.get(i) - want.get(i)));
    top = std::max(top, std::abs(want.get(i)));
  }
  return top > 0 ? err / top : err;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace trisparse;
  std::int64_t dim = 128;
  int repeat = 10;
  std::vector<std::string> graphs;
  CLI::App app{"CPU sparse kernels against the float64 oracle"};
  app.add_option("graphs", graphs, "graph files")->required();
  app.add_option("--dim", dim, "feature width (SpMM n, SDDMM d, layers in = out)")
      ->capture_default_str();
  app.add_option("--repeat", repeat, "timed runs of the fast paths")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  for (const auto& path : graphs) {
    const csr_graph g = read_graph(path);
    const std::int64_t n = g.rows, nnz = g.nnz();
    host_tensor x(dtype::f32, n, 1, dim), y(dtype::f32, g.cols, 1, dim), w(dtype::f32, dim, 1, dim),
        s(dtype::f32, nnz, 1, 1);
    x.fill_uniform(-1, 1, 1);
    y.fill_uniform(-1, 1, 2);
    w.fill_uniform(-0.1, 0.1, 3);
    s.fill_uniform(-2, 2, 4);
    const sparse_plan plan = sparse_plan::build(g);
    nlohmann::json j{{"graph", path},
                     {"rows", n},
                     {"nnz", nnz},
                     {"dim", dim},
                     {"threads", omp_get_max_threads()}};
    const auto op = [&](const char* name, auto&& fast, auto&& oracle, host_tensor& got,
                        host_tensor& want) {
      fast();  // warm-up
      const double fast_ms = median_ms(repeat, fast);
      const double oracle_ms = median_ms(1, oracle);
      j[std::string(name) + "_ms"] = fast_ms;
      j[std::string(name) + "_oracle_ms"] = oracle_ms;
      j[std::string(name) + "_vs_oracle"] = oracle_ms / fast_ms;
      j[std::string(name) + "_error"] = relative_error(got, want);
    };
    {
      host_tensor c(dtype::f32, n, 1, dim), ref(dtype::f64, n, 1, dim);
      op(
          "spmm", [&] { plan.spmm({}, y.view(), c.view()); },
          [&] { reference::spmm(g, {}, y.view(), ref.view()); }, c, ref);
    }
    {
      host_tensor o(dtype::f32, nnz, 1, 1), ref(dtype::f64, nnz, 1, 1);
      op(
          "sddmm", [&] { plan.sddmm(x.view(), y.view(), o.view(), 0.125); },
          [&] { reference::sddmm(g, x.view(), y.view(), ref.view(), 0.125); }, o, ref);
    }
    {
      host_tensor o(dtype::f32, nnz, 1, 1), ref(dtype::f64, nnz, 1, 1);
      op(
          "softmax", [&] { plan.softmax(s.view(), o.view()); },
          [&] { reference::softmax(g, s.view(), ref.view()); }, o, ref);
    }
    if (g.rows == g.cols) {
      const gcn_layer gcn = gcn_layer::build(g);
      const csr_graph a_hat = gcn_normalized(g);
      host_tensor o(dtype::f32, n, 1, dim), ref(dtype::f64, n, 1, dim);
      op(
          "gcn", [&] { gcn.forward(x.view(), w.view(), o.view()); },
          [&] { reference::gcn_fused(a_hat, x.view(), w.view(), {}, false, ref.view()); }, o, ref);
      const agnn_layer agnn = agnn_layer::build(g);
      host_tensor h(dtype::f32, n, 1, dim), ho(dtype::f32, n, 1, dim), href(dtype::f64, n, 1, dim);
      h.fill_uniform(-1, 1, 5);
      // The oracle: unit rows, their cosines, the softmax and SpMM over A + I, all in float64.
      csr_graph loops = gcn_normalized(g);  // A + I, as the layer builds it, without weights
      loops.values.clear();
      op(
          "agnn", [&] { agnn.forward(h.view(), 1.0, ho.view()); },
          [&] {
            host_tensor unit(dtype::f64, n, 1, dim), sc(dtype::f64, loops.nnz(), 1, 1),
                pr(dtype::f64, loops.nnz(), 1, 1);
            for (std::int64_t i = 0; i < n; ++i) {
              double sum = 0;
              for (std::int64_t f = 0; f < dim; ++f) sum += h.get(i * dim + f) * h.get(i * dim + f);
              for (std::int64_t f = 0; f < dim; ++f)
                unit.set(i * dim + f, sum > 0 ? h.get(i * dim + f) / std::sqrt(sum) : 0.0);
            }
            reference::sddmm(loops, unit.view(), unit.view(), sc.view(), 1.0);
            reference::softmax(loops, sc.view(), pr.view());
            reference::spmm(loops, pr.view(), h.view(), href.view());
          },
          ho, href);
    }
    std::cout << j.dump() << std::endl;
  }
  return 0;
}
