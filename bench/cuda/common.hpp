#pragma once
// What the GPU benchmarks share (bench only): CUDA checks, device allocations, event timing of a
// kernel behind a busy-wait, and the graphs they run on (files or generated specs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "baselines.hpp"
#include "trisparse/trisparse.hpp"

namespace trisparse::bench {

inline void check(cudaError_t e, const char* what) {
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

struct timing {
  double median = 0, min = 0, max = 0;
};

// Median of `repeat` event-timed runs after 3 warm-ups, rotating input sets. queued: a busy-wait
// kernel runs first so that the events bracket GPU work only (the kernel time a profiler shows);
// otherwise the host's issue time between the events counts too (the call's latency).
inline timing time_runs(int repeat, int sets, bool queued, const std::function<void(int)>& run) {
  for (int i = 0; i < 3; ++i) run(i % sets);
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int i = 0; i < repeat; ++i) {
    if (queued) bench::gpu_busy_wait(200);
    check(cudaEventRecord(start), "record");
    run(i % sets);
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    ms.push_back(t);
  }
  check(cudaGetLastError(), "timed runs");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

/// SuiteSparse-like matrices of `rows` rows by class (generate_sparse_matrix, seed 7): fem
/// (constant 32 per row in a band of +-128), circuit (power law, exponent 1.6, mean 6), web
/// (power law, exponent 1.3, mean 12), lp (uniform lengths, mean 12, twice as many columns, 4 dense
/// rows), uniform (uniform lengths, mean 16, random columns), hub (uniform, mean 16, and one row
/// holding half of all columns: hub:400000 has a 200K-neighbour hub). Empty options for another
/// name.
inline std::optional<sparse_matrix_options> matrix_class(const std::string& kind,
                                                         std::int64_t rows) {
  sparse_matrix_options o{.rows = rows, .seed = 7};
  if (kind == "fem") {
    o.lengths = row_length_law::constant;
    o.avg_row = 32;
    o.band = 128;
  } else if (kind == "circuit") {
    o.lengths = row_length_law::power_law;
    o.exponent = 1.6;
    o.avg_row = 6;
  } else if (kind == "web") {
    o.lengths = row_length_law::power_law;
    o.exponent = 1.3;
    o.avg_row = 12;
  } else if (kind == "lp") {
    o.lengths = row_length_law::uniform;
    o.avg_row = 12;
    o.cols = 2 * rows;
    o.dense_rows = 4;
  } else if (kind == "uniform") {
    o.lengths = row_length_law::uniform;
    o.avg_row = 16;
  } else if (kind == "hub") {
    o.lengths = row_length_law::uniform;
    o.avg_row = 16;
    o.dense_rows = 1;
  } else {
    return std::nullopt;
  }
  return o;
}

/// A graph file, or a generated graph: rmatSCALE:EF, erNODES:DEG, batchGRAPHS:MIN:MAX,
/// CLASS:ROWS of matrix_class (seed 7). Returns (short name, graph).
inline std::pair<std::string, csr_graph> load_graph(const std::string& p) {
  csr_graph g;
  const auto colon = p.find(':');
  if (colon != std::string::npos && matrix_class(p.substr(0, colon), 0)) {
    std::string name = p;
    std::replace(name.begin(), name.end(), ':', '_');  // fem_100000
    return {name, generate_sparse_matrix(
                      *matrix_class(p.substr(0, colon), std::stoll(p.substr(colon + 1))))};
  }
  if (p.rfind("rmat", 0) == 0 && colon != std::string::npos) {
    g = generate_rmat({.scale = std::stoi(p.substr(4, colon - 4)),
                       .edge_factor = std::stod(p.substr(colon + 1)),
                       .seed = 7});
  } else if (p.rfind("batch", 0) == 0 && colon != std::string::npos) {
    const auto second = p.find(':', colon + 1);
    g = generate_batch({.graphs = std::stoll(p.substr(5, colon - 5)),
                        .min_nodes = std::stoll(p.substr(colon + 1, second - colon - 1)),
                        .max_nodes = std::stoll(p.substr(second + 1)),
                        .seed = 7})
            .graph;
  } else if (p.rfind("er", 0) == 0 && colon != std::string::npos) {
    g = generate_erdos_renyi({.rows = std::stoll(p.substr(2, colon - 2)),
                              .avg_degree = std::stod(p.substr(colon + 1)),
                              .seed = 7});
  } else {
    g = read_graph(p);
  }
  std::string name = p.substr(p.find_last_of('/') + 1);
  if (name.rfind("batch", 0) == 0)
    std::replace(name.begin(), name.end(), ':', '_');  // batch1024_10_40
  else
    name = name.substr(0, std::min(name.find(".el"), name.find(':')));
  return {name, std::move(g)};
}

}  // namespace trisparse::bench
