// GPU block-sparse attention benchmark (the report's sweep): per (N, p, G, seed), the mask (random
// layout, diagonal kept), the plan build time, the kernel time (median of event-timed runs after
// warm-up, rotating input sets), effective TFLOP/s (4 · attended pairs · D · heads), our kernel on
// a dense mask at the same N as the in-project dense baseline, and a check of sampled rows of
// every timed output against float64. One JSON object per line. With --export DIR, each mask is
// written as DIR/<name>.u8 (uint8 [mask heads, N/G, N/G], 1 = kept) for the PyTorch script.
//   bench_block_sparse [--n N,...] [--p P,...] [--g G,...] [--seeds S] [--heads H] [--dim D]
//                      [--dtype f16|bf16] [--causal] [--repeat R] [--max-pairs X] [--export DIR]
//                      [--topk K,...] [--unfused] [--max-unfused-pairs X] [--heads-first]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.hpp"
#include "trisparse/trisparse.hpp"

namespace {

using namespace trisparse;
using bench::check;
using bench::device_mem;
using bench::time_runs;

struct inputs {
  std::vector<host_tensor> host;  // q, k, v of set 0 (for the accuracy check)
  std::vector<std::unique_ptr<device_mem>> mem;
  std::vector<tensor_view> views;  // [set * 3 + {q, k, v}]
  bool heads_first = false;        // laid out [heads, rows, dim] (device_view)
};

// [a, b, item] -> [b, a, item] (items of item_bytes): [rows, heads, dim] to [heads, rows, dim]
// with a = rows, and back with a = heads.
std::vector<std::byte> swap_outer(const std::byte* src, std::int64_t a, std::int64_t b,
                                  std::size_t item_bytes) {
  std::vector<std::byte> dst(static_cast<std::size_t>(a * b) * item_bytes);
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j)
      std::copy_n(src + static_cast<std::size_t>(i * b + j) * item_bytes, item_bytes,
                  dst.data() + static_cast<std::size_t>(j * a + i) * item_bytes);
  return dst;
}

const char* layout_name(bool heads_first) {
  return heads_first ? "heads,rows,dim" : "rows,heads,dim";
}

// A [rows, heads, dim] view of device memory laid out [rows, heads, dim], or with heads_first
// [heads, rows, dim] (PyTorch's [batch, heads, N, dim], what SDPA and flex_attention are given).
tensor_view device_view(const host_tensor& h, void* data, bool heads_first) {
  tensor_view v = h.view();
  v.data = data;
  v.where = device_kind::cuda;
  if (heads_first) {
    v.row_stride = v.dim;
    v.head_stride = v.rows * v.dim;
  }
  return v;
}

// `sets` sets of Q, K, V, uniform in [-1, 1), on the device (laid out as device_view says).
inputs make_inputs(dtype t, std::int64_t n, std::int64_t heads, std::int64_t dim, int sets,
                   std::uint64_t seed, bool heads_first) {
  inputs x;
  x.heads_first = heads_first;
  for (int s = 0; s < sets; ++s) {
    for (int w = 0; w < 3; ++w) {
      host_tensor h(t, n, heads, dim);
      h.fill_uniform(-1, 1, seed + static_cast<std::uint64_t>(3 * s + w));
      x.mem.push_back(std::make_unique<device_mem>(h.size_bytes()));
      const std::vector<std::byte> staged =
          heads_first ? swap_outer(h.data(), n, heads, static_cast<std::size_t>(dim) * size_of(t))
                      : std::vector<std::byte>{};
      check(cudaMemcpy(x.mem.back()->p, heads_first ? staged.data() : h.data(), h.size_bytes(),
                       cudaMemcpyHostToDevice),
            "upload");
      const tensor_view v = device_view(h, x.mem.back()->p, heads_first);
      x.views.push_back(v);
      if (s == 0) x.host.push_back(std::move(h));
    }
  }
  return x;
}

// Max normwise relative error of sampled rows (all heads) against float64 attention computed
// straight from the mask.
double check_rows(const block_sparse_mask& m, const inputs& x, const host_tensor& out, double scale,
                  std::uint64_t seed) {
  const host_tensor &q = x.host[0], &k = x.host[1], &v = x.host[2];
  const std::int64_t heads = q.heads(), dim = q.dim(), g = m.block;
  rng r(seed);
  double max_err = 0, max_ref = 0;
  // 64 rows up to N = 8K, fewer beyond (at least 8): the check's cost grows with N.
  const auto samples = static_cast<int>(std::clamp<std::int64_t>(64 * 8192 / m.len_q(0), 8, 64));
  for (int sample = 0; sample < samples; ++sample) {
    const auto i = static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(m.len_q(0))));
    for (std::int64_t h = 0; h < heads; ++h) {
      const csr_graph& blocks = m.at(0, h).blocks;
      std::vector<std::int64_t> keys;
      for (std::int64_t e = blocks.row_ptr[i / g]; e < blocks.row_ptr[i / g + 1]; ++e) {
        for (std::int64_t j = blocks.col_idx[e] * g;
             j < std::min((blocks.col_idx[e] + 1) * g, m.last_key(0, i) + 1); ++j)
          keys.push_back(j);
      }
      std::vector<double> s(keys.size());
      double mx = -1e300;
      for (std::size_t a = 0; a < keys.size(); ++a) {
        double dot = 0;
        for (std::int64_t c = 0; c < dim; ++c)
          dot += q.get(q.view().offset(i, h, c)) * k.get(k.view().offset(keys[a], h, c));
        s[a] = dot * scale;
        mx = std::max(mx, s[a]);
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (std::int64_t c = 0; c < dim; ++c) {
        double want = 0;
        for (std::size_t a = 0; a < keys.size(); ++a)
          want += s[a] * v.get(v.view().offset(keys[a], h, c));
        want = keys.empty() ? 0.0 : want / sum;
        const double got = out.get(out.view().offset(i, h, c));
        if (!std::isfinite(got)) return INFINITY;
        max_err = std::max(max_err, std::abs(got - want));
        max_ref = std::max(max_ref, std::abs(want));
      }
    }
  }
  return max_err / std::max(max_ref, 1e-300);
}

void export_mask(const block_sparse_mask& m, const std::string& path) {
  const std::int64_t nb = m.masks[0].blocks.rows, nc = m.masks[0].blocks.cols;
  std::vector<std::uint8_t> dense(static_cast<std::size_t>(m.heads * nb * nc), 0);
  for (std::int64_t h = 0; h < m.heads; ++h) {
    const csr_graph& b = m.masks[static_cast<std::size_t>(h)].blocks;
    for (std::int64_t r = 0; r < nb; ++r)
      for (std::int64_t e = b.row_ptr[r]; e < b.row_ptr[r + 1]; ++e)
        dense[static_cast<std::size_t>((h * nb + r) * nc + b.col_idx[e])] = 1;
  }
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(dense.data()), static_cast<std::streamsize>(dense.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// An f16 output [rows, heads, dim] on the device (laid out like the inputs) and its host copy:
// poisoned, written once by `run`, downloaded and checked against float64 on sampled rows.
struct device_output {
  host_tensor host;
  device_mem mem;
  bool heads_first;
  tensor_view view;
  device_output(const tensor_view& q, std::int64_t heads, bool first)
      : host(dtype::f16, q.rows, heads, q.dim),
        mem(host.size_bytes()),
        heads_first(first),
        view(device_view(host, mem.p, first)) {}
  double check_once(const block_sparse_mask& mask, const inputs& x, std::uint64_t seed,
                    const std::function<void()>& run) {
    check(cudaMemset(mem.p, 0xFF, host.size_bytes()), "poison");
    run();
    check(cudaMemcpy(host.data(), mem.p, host.size_bytes(), cudaMemcpyDeviceToHost), "download");
    if (heads_first) {
      const std::vector<std::byte> rows_first = swap_outer(
          host.data(), host.heads(), host.rows(), static_cast<std::size_t>(host.dim()) * 2);
      std::copy(rows_first.begin(), rows_first.end(), host.data());
    }
    return check_rows(mask, x, host, 1.0 / std::sqrt(static_cast<double>(view.dim)), seed);
  }
};

struct result {
  double ms = 0, build_s = 0, error = 0;
  std::array<double, 3> stage_ms{};  // cuda_block_unfused: SDDMM, softmax, SpMM
  std::int64_t pairs = 0;
  std::string algo, format;
};

result run_one(const block_sparse_mask& mask, const inputs& x, std::int64_t heads, int repeat,
               std::uint64_t seed, block_sparse_plan_options options = {}) {
  result res;
  const auto t0 = std::chrono::steady_clock::now();
  const auto plan = block_sparse_attention_plan::build(mask, device_kind::cuda, options);
  check(cudaDeviceSynchronize(), "plan");
  res.build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.algo = backend_name(plan.report().algo, plan.report().where, true);
  res.format = plan.report().format;
  res.pairs = plan.report().nnz * (mask.heads == 1 ? heads : 1);
  device_output out(x.views[0], heads, x.heads_first);
  const int sets = static_cast<int>(x.views.size() / 3);
  const auto call = [&](int s) {
    plan.run(x.views[3 * s], x.views[3 * s + 1], x.views[3 * s + 2], out.view);
  };
  res.error = out.check_once(mask, x, seed, [&] { call(0); });
  res.ms = time_runs(repeat, sets, true, call).median;
  if (plan.report().algo == algorithm::unfused) {  // per-kernel medians
    std::vector<std::array<double, 3>> runs;
    for (int i = 0; i < std::max(3, repeat / 4); ++i) {
      const int s = i % sets;
      runs.push_back(
          plan.run_timing_stages(x.views[3 * s], x.views[3 * s + 1], x.views[3 * s + 2], out.view));
    }
    for (std::size_t k = 0; k < 3; ++k) {
      std::vector<double> v;
      for (const auto& r : runs) v.push_back(r[k]);
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
      res.stage_ms[k] = v[v.size() / 2];
    }
  }
  return res;
}

// Dynamic top-k masks (--topk K): the device's selection from Q and K against the attention
// under the mask it selects, both event-timed on rotating inputs; the selected mask is checked
// against float64 like every other.
nlohmann::json run_topk(const inputs& x, std::int64_t n, std::int64_t g, std::int64_t heads,
                        std::int64_t top_k, bool causal, int repeat) {
  const std::vector<std::int64_t> cu{0, n};
  auto plan = topk_block_sparse_plan::build(cu, cu, heads, x.views[0].dim,
                                            {.block = g, .top_k = top_k, .causal = causal});
  const tensor_view& q0 = x.views[0];
  device_output out(q0, heads, x.heads_first);
  const int sets = static_cast<int>(x.views.size() / 3);
  const auto select = [&](int s) { plan.select(x.views[3 * s], x.views[3 * s + 1]); };
  const double select_ms = time_runs(repeat, sets, true, select).median;
  select(0);
  const block_sparse_mask mask = plan.mask();
  const auto run = [&](int s) {
    plan.run(x.views[3 * s], x.views[3 * s + 1], x.views[3 * s + 2], out.view);
  };
  const double attention_ms = time_runs(repeat, sets, true, run).median;
  // Both on the same inputs: select, then attend (what a caller does every step).
  const auto both = [&](int s) {
    select(s);
    run(s);
  };
  const double both_ms = time_runs(repeat, sets, true, both).median;
  // The floor of any selection from block means: reading Q and K once.
  const auto bytes = [](const tensor_view& t) {
    return static_cast<std::size_t>(t.rows * t.heads * t.dim) * size_of(t.type);
  };
  const auto read = [&](int s) {
    const tensor_view &q = x.views[3 * s], &k = x.views[3 * s + 1];
    bench::read_once(q.data, bytes(q), k.data, bytes(k));
  };
  const double read_ms = time_runs(repeat, sets, true, read).median;
  select(0);
  const double error = out.check_once(mask, x, 1, [&] { run(0); });
  return {{"n", n},
          {"g", g},
          {"top_k", top_k},
          {"heads", heads},
          {"dim", q0.dim},
          {"causal", causal},
          {"layout", layout_name(x.heads_first)},
          {"format", plan.report().format},
          {"density", mask.density()},
          {"select_ms", select_ms},
          {"attention_ms", attention_ms},
          {"select_and_attention_ms", both_ms},
          {"select_over_attention", select_ms / attention_ms},
          {"read_qk_ms", read_ms},
          {"read_qk_over_attention", read_ms / attention_ms},
          {"max_rel_error", error}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"block-sparse attention benchmark (H200)"};
  std::vector<std::int64_t> ns{1024, 4096, 16384, 32768}, gs{64, 128};
  std::vector<double> ps{0.5, 0.9, 0.95, 0.99};
  std::int64_t heads = 8, dim = 64, max_pairs = std::int64_t{1} << 31;
  int seeds = 1, repeat = 20;
  std::string type = "f16", export_dir;
  bool causal = false, unfused = false, with_mma_sync = true, with_one_group = false,
       heads_first = false;
  std::int64_t max_unfused = std::int64_t{1} << 33;
  std::vector<std::int64_t> topks;
  app.add_option("--topk", topks,
                 "instead of random masks: top-k masks selected on the device, these k")
      ->delimiter(',');
  app.add_option("--n", ns, "sequence lengths")->delimiter(',');
  app.add_option("--p", ps, "sparsities (fraction of blocks dropped)")->delimiter(',');
  app.add_option("--g", gs, "block sizes")->delimiter(',');
  app.add_option("--seeds", seeds);
  app.add_option("--heads", heads);
  app.add_option("--dim", dim);
  app.add_option("--dtype", type);
  app.add_option("--repeat", repeat);
  app.add_option("--max-pairs", max_pairs,
                 "skip blocks finer than 16 (run as element patterns) with more pairs");
  app.add_option("--export", export_dir, "write each mask for bench/python/block_sparse.py");
  app.add_flag("--causal", causal);
  app.add_flag("--heads-first", heads_first,
               "Q, K, V and the output laid out [heads, N, dim] (as PyTorch's SDPA and "
               "flex_attention get them) instead of [N, heads, dim]");
  app.add_flag("!--no-mma-sync", with_mma_sync, "skip the mma.sync kernel beside wgmma");
  app.add_flag("--one-group", with_one_group,
               "time the one-warpgroup wgmma kernel beside the two-warpgroup one");
  app.add_flag("--unfused", unfused, "also time the report's three kernels (cuda_block_unfused)");
  app.add_option("--max-unfused-pairs", max_unfused,
                 "skip the three kernels on masks with more pairs (all heads of one mask)");
  CLI11_PARSE(app, argc, argv);
  const dtype t = parse_dtype(type);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  for (const std::int64_t n : ns) {
    // Input sets: enough to exceed the L2 where they are small.
    const std::int64_t set_bytes = 3 * n * heads * dim * 2;
    const int sets = static_cast<int>(std::clamp<std::int64_t>(
        2 * prop.l2CacheSize / std::max<std::int64_t>(set_bytes, 1) + 1, 1, 4));
    const inputs x =
        make_inputs(t, n, heads, dim, sets, static_cast<std::uint64_t>(n), heads_first);
    const std::vector<std::int64_t> lens{n};
    if (!topks.empty()) {
      for (const std::int64_t g : gs) {
        for (const std::int64_t k : topks) {
          nlohmann::json j = run_topk(x, n, g, heads, k, causal, repeat);
          j["gpu"] = prop.name;
          j["dtype"] = type;
          std::cout << j.dump() << std::endl;
        }
      }
      continue;
    }
    // In-project dense baseline: our kernel on a dense mask (G = 128).
    const auto dense = make_block_sparse_mask(
        {.layout = block_layout::dense, .block = 128, .causal = causal}, lens);
    const result d = run_one(dense, x, heads, repeat, 1);
    for (const std::int64_t g : gs) {
      for (const double p : ps) {
        for (int seed = 1; seed <= seeds; ++seed) {
          const auto point_start = std::chrono::steady_clock::now();
          const auto seconds_since = [](std::chrono::steady_clock::time_point since) {
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
          };
          nlohmann::json j{{"n", n},
                           {"p", p},
                           {"g", g},
                           {"seed", seed},
                           {"heads", heads},
                           {"dim", dim},
                           {"dtype", type},
                           {"causal", causal},
                           {"layout", layout_name(heads_first)},
                           {"gpu", prop.name},
                           {"dense_ours_ms", d.ms},
                           {"dense_ours_error", d.error}};
          // Fine blocks: skip before building a mask of N^2 (1 - p) blocks a head.
          const double expected = static_cast<double>(n) * static_cast<double>(n) * (1 - p) *
                                  static_cast<double>(heads);
          if (g % 16 != 0 && expected > static_cast<double>(max_pairs)) {
            j["skipped"] = "element pattern of more than --max-pairs pairs (about " +
                           std::to_string(static_cast<std::int64_t>(expected)) + ")";
            std::cout << j.dump() << std::endl;
            continue;
          }
          const auto mask = make_block_sparse_mask({.layout = block_layout::random,
                                                    .block = g,
                                                    .p = p,
                                                    .causal = causal,
                                                    .heads = heads,
                                                    .seed = static_cast<std::uint64_t>(seed)},
                                                   lens);
          j["mask_s"] = seconds_since(point_start);  // host time drawing the mask
          const std::int64_t pairs_bound = mask.active_blocks() * g * g;
          j["density"] = mask.density();
          if (g % 16 != 0 && pairs_bound > max_pairs) {  // element patterns (the BSB path)
            j["skipped"] = "element pattern of more than --max-pairs pairs (" +
                           std::to_string(pairs_bound) + ")";
            std::cout << j.dump() << std::endl;
            continue;
          }
          const result r = run_one(mask, x, heads, repeat, static_cast<std::uint64_t>(seed));
          j["algo"] = r.algo;
          j["format"] = r.format;
          j["ms"] = r.ms;
          if (with_mma_sync && r.format.find("wgmma") != std::string::npos) {  // the sm_80 kernel
            const result mma = run_one(mask, x, heads, repeat, static_cast<std::uint64_t>(seed),
                                       {.kernel = block_kernel::mma_sync});
            j["mma_sync_ms"] = mma.ms;
            j["mma_sync_max_rel_error"] = mma.error;
          }
          if (with_one_group && r.format.find("two warpgroups") != std::string::npos) {
            const result one = run_one(mask, x, heads, repeat, static_cast<std::uint64_t>(seed),
                                       {.kernel = block_kernel::wgmma});
            j["one_group_ms"] = one.ms;
            j["one_group_max_rel_error"] = one.error;
          }
          j["build_ms"] = 1e3 * r.build_s;
          j["pairs"] = r.pairs;
          j["tflops"] = 4.0 * static_cast<double>(r.pairs) * static_cast<double>(dim) / r.ms * 1e-9;
          j["speedup_vs_dense_ours"] = d.ms / r.ms;
          j["max_rel_error"] = r.error;
          if (unfused && pairs_bound <= max_unfused) {  // the report's three kernels
            const result u = run_one(mask, x, heads, repeat, static_cast<std::uint64_t>(seed),
                                     {.algo = algorithm::unfused});
            j["unfused_ms"] = u.ms;
            j["unfused_sddmm_ms"] = u.stage_ms[0];
            j["unfused_softmax_ms"] = u.stage_ms[1];
            j["unfused_spmm_ms"] = u.stage_ms[2];
            j["unfused_max_rel_error"] = u.error;
            j["unfused_speedup_vs_dense_ours"] = d.ms / u.ms;
          }
          if (!export_dir.empty() && g % 16 == 0) {  // flex_attention takes G >= 16
            const std::string name = "mask_n" + std::to_string(n) + "_g" + std::to_string(g) +
                                     "_p" + std::to_string(p) + "_s" + std::to_string(seed) +
                                     (causal ? "_causal" : "");
            export_mask(mask, export_dir + "/" + name + ".u8");
            j["mask_file"] = name + ".u8";
          }
          j["point_s"] = seconds_since(point_start);  // wall time of the whole point
          std::cout << j.dump() << std::endl;
        }
      }
    }
  }
  return 0;
}
