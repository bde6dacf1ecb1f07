// GPU fused 3S benchmark: per graph, plan build time (host BSB + upload), kernel time (median of
// event-timed runs after warm-up, rotating input sets larger than the L2), useful GFLOP/s
// (4·nnz·d·heads), compulsory bandwidth, and a check of the timed output against float64 on
// sampled rows. One JSON object per line.
//   bench_fused3s [--dim D] [--heads H] [--repeat R] [--dtype f16|bf16] [--split N,N,...]
//                 [--rmat SCALE:EDGEFACTOR]... GRAPH...
#include <cuda_runtime.h>
#include <omp.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trisparse/trisparse.hpp"

namespace {

using namespace trisparse;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct device_mem {
  void* p = nullptr;
  explicit device_mem(std::size_t bytes) {
    check(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
  }
  ~device_mem() { cudaFree(p); }
  device_mem(const device_mem&) = delete;
  device_mem& operator=(const device_mem&) = delete;
};

// Uniform [0, 1) in parallel (independent streams per chunk), as the given 16-bit type.
void fill_uniform16(host_tensor& t, std::uint64_t seed) {
  const std::int64_t n = t.numel(), chunk = 1 << 16;
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    rng r(seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(c));
    for (std::int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) t.set(i, r.uniform());
  }
}

void bench(const std::string& name, const csr_graph& g, std::int64_t dim, std::int64_t heads,
           dtype in, int repeat, std::int32_t split) {
  const auto t0 = std::chrono::steady_clock::now();
  const attention_plan plan = attention_plan::build(g, device_kind::cuda, {.split_tcbs = split});
  check(cudaDeviceSynchronize(), "plan");
  const double build_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

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
  const attention_options opts{.scale = 1.0};
  const auto run = [&](int s) {
    plan.run(view(hq[s], dq[s]->p), view(hk[s], dk[s]->p), view(hv[s], dv[s]->p),
             view(hout, dout.p), opts);
  };
  for (int i = 0; i < 3; ++i) run(i % sets);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int i = 0; i < repeat; ++i) {
    check(cudaEventRecord(start), "record");
    run(i % sets);
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    ms.push_back(t);
  }
  check(cudaGetLastError(), "kernel");
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  // Check the last timed set's output against float64 on sampled rows (poisoned first).
  const int last = (repeat - 1) % sets;
  check(cudaMemset(dout.p, 0xFF, hout.size_bytes()), "poison");
  run(last);
  check(cudaMemcpy(hout.data(), dout.p, hout.size_bytes(), cudaMemcpyDeviceToHost), "download");
  std::vector<std::int64_t> rows;
  rng r(now);
  for (int i = 0; i < 256 && g.rows > 0; ++i)
    rows.push_back(static_cast<std::int64_t>(r.below(g.rows)));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const csr_graph sub = select_rows(g, rows);
  host_tensor qs(in, sub.rows, heads, dim), ref(dtype::f64, sub.rows, heads, dim);
  const std::int64_t w = heads * dim;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t e = 0; e < w; ++e)
      qs.set(static_cast<std::int64_t>(i) * w + e, hq[last].get(rows[i] * w + e));
  }
  reference::attention(sub, qs.view(), hk[last].view(), hv[last].view(), ref.view(), 1.0);
  double max_abs = 0, max_ref = 0;
  bool finite = true;
  for (std::int64_t i = 0; i < hout.numel(); ++i) finite = finite && std::isfinite(hout.get(i));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t e = 0; e < w; ++e) {
      const double o = hout.get(rows[i] * w + e),
                   rf = ref.get(static_cast<std::int64_t>(i) * w + e);
      max_abs = std::max(max_abs, std::abs(o - rf));
      max_ref = std::max(max_ref, std::abs(rf));
    }
  }
  const double nnz = static_cast<double>(g.nnz()), hd = static_cast<double>(w);
  const double bytes = 2 * hd * static_cast<double>(g.rows + 2 * g.cols) +
                       4 * hd * static_cast<double>(g.rows) +
                       static_cast<double>(plan.report().format_bytes);
  nlohmann::json j{{"graph", name},
                   {"rows", g.rows},
                   {"nnz", g.nnz()},
                   {"dim", dim},
                   {"heads", heads},
                   {"dtype", to_string(in)},
                   {"kernel_ms", med},
                   {"kernel_ms_min", ms.front()},
                   {"kernel_ms_max", ms.back()},
                   {"build_ms", build_ms},
                   {"gflops", 4 * nnz * hd / med * 1e-6},
                   {"compulsory_gbps", bytes / med * 1e-6},
                   {"input_sets", sets},
                   {"split_tcbs", split},
                   {"max_rel_error", max_abs / std::max(max_ref, 1e-300)},
                   {"all_finite", finite}};
  std::cout << j.dump() << std::endl;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
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
  std::int64_t dim = 128, heads = 1;
  int repeat = 20;
  dtype in = dtype::f16;
  std::vector<std::int32_t> splits{0};
  std::vector<std::string> paths, rmats;
  std::string dtype_name = "f16";
  CLI::App app{"GPU fused 3S benchmark"};
  app.add_option("graphs", paths, "graph files");
  app.add_option("--dim", dim, "head dimension")->capture_default_str();
  app.add_option("--heads", heads, "heads")->capture_default_str();
  app.add_option("--repeat", repeat, "timed runs")->capture_default_str();
  app.add_option("--dtype", dtype_name, "f16 or bf16")->capture_default_str();
  app.add_option("--split", splits, "split thresholds to sweep, comma-separated (0 = cost model)")
      ->delimiter(',');
  app.add_option("--rmat", rmats, "generated R-MAT graphs SCALE:EDGE_FACTOR (after the files)");
  CLI11_PARSE(app, argc, argv);
  for (const auto& r : rmats) paths.push_back("rmat" + r);
  try {
    in = parse_dtype(dtype_name);
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "properties");
    std::cout << nlohmann::json{{"device", prop.name},
                                {"sms", prop.multiProcessorCount},
                                {"copy_bandwidth_gbps", copy_bandwidth_gbps()}}
                     .dump()
              << std::endl;
    for (const auto& p : paths) {
      csr_graph g;
      if (p.rfind("rmat", 0) == 0 && p.find(':') != std::string::npos) {
        const int scale = std::stoi(p.substr(4, p.find(':') - 4));
        g = generate_rmat(
            {.scale = scale, .edge_factor = std::stod(p.substr(p.find(':') + 1)), .seed = 7});
      } else {
        g = read_graph(p);
      }
      std::string name = p.substr(p.find_last_of('/') + 1);
      name = name.substr(0, std::min(name.find(".el"), name.find(':')));
      for (const auto split : splits) bench(name, g, dim, heads, in, repeat, split);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fused3s: %s\n", e.what());
    return 1;
  }
  return 0;
}
