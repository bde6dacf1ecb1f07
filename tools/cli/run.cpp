// trisparse run [GRAPH]: sparse attention on a graph (or the embedded default), timed and checked.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "commands.hpp"
#include "progress.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/core/random.hpp"
#include "trisparse/graph/generate.hpp"
#include "trisparse/ops/attention.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse::cli {

namespace {

struct run_args {
  std::string path;
  read_options read;
  std::int64_t dim = 64, heads = 1, repeat = 10, check_rows = 256;
  std::string type = "auto", out_type = "f32", algo = "automatic", range = "signed", save,
              device = "auto";
  std::optional<double> scale;
  std::uint64_t seed = 0;
  bool json = false;
};

// The embedded default: a seeded power-law (R-MAT) graph, symmetric, no self loops.
csr_graph default_graph() {
  phase p("generating the default graph (R-MAT, 2^15 nodes, edge factor 8)");
  return generate_rmat({.scale = 15, .edge_factor = 8, .seed = 42});
}

std::string npy_descr(dtype t) {
  switch (t) {
    case dtype::f16:
      return "<f2";
    case dtype::f64:
      return "<f8";
    default:
      return "<f4";  // bf16 is saved widened to f32 (exact)
  }
}

void save_tensor(const std::filesystem::path& path, const host_tensor& t) {
  const std::vector<std::int64_t> shape{t.rows(), t.heads(), t.dim()};
  if (t.type() == dtype::bf16) {
    std::vector<float> wide(static_cast<std::size_t>(t.numel()));
    for (std::int64_t i = 0; i < t.numel(); ++i) wide[i] = static_cast<float>(t.get(i));
    write_npy(path, "<f4", shape, wide.data(), wide.size() * 4);
  } else {
    write_npy(path, npy_descr(t.type()), shape, t.data(), t.size_bytes());
  }
}

int run_run(const run_args& a) {
  const algorithm requested = parse_algorithm(a.algo);
  // The best backend present: CUDA when a device is visible and runs the algorithm asked for.
  const device_kind where =
      a.device == "cuda" ||
              (a.device == "auto" && runs_on(requested, device_kind::cuda) && cuda_available())
          ? device_kind::cuda
          : device_kind::cpu;
  // Tensor cores take 16-bit inputs; the CPU engine computes in fp32.
  const dtype in_t = parse_dtype(a.type != "auto"             ? a.type
                                 : where == device_kind::cuda ? "f16"
                                                              : "f32");
  const dtype out_t = parse_dtype(a.out_type);
  TRISPARSE_EXPECTS_INPUT(a.dim >= 1 && a.heads >= 1 && a.repeat >= 1,
                          "--dim, --heads and --repeat must be >= 1");
  const csr_graph g = a.path.empty() ? default_graph() : load(a.path, a.read);
  const std::string graph_name = a.path.empty() ? "default (R-MAT scale 15)" : a.path;

  attention_plan plan;
  {
    phase p("building the plan");
    plan = attention_plan::build(
        g, where, {.algo = requested, .workspace_heads = a.heads, .workspace_dim = a.dim});
  }

  // Fresh random inputs each run unless --seed is given.
  const std::uint64_t seed =
      a.seed != 0
          ? a.seed
          : static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const double lo = a.range == "unit" ? 0.0 : -1.0;
  host_tensor q(in_t, g.rows, a.heads, a.dim), k(in_t, g.cols, a.heads, a.dim),
      v(in_t, g.cols, a.heads, a.dim);
  host_tensor out(out_t, g.rows, a.heads, a.dim);
  q.fill_uniform(lo, 1.0, seed);
  k.fill_uniform(lo, 1.0, seed + 1);
  v.fill_uniform(lo, 1.0, seed + 2);
  const attention_options opts{.scale = a.scale, .algo = requested};

  std::vector<double> times;
  {
    phase p("running " + std::string(to_string(plan.resolve(requested))) + " (" +
            std::to_string(a.repeat) + " timed runs)");
    host_tensor scratch(out_t, g.rows, a.heads, a.dim);
    if (where == device_kind::cuda) {
      const device_tensor dq(q), dk(k), dv(v);
      device_tensor dout(out_t, g.rows, a.heads, a.dim), dscratch(out_t, g.rows, a.heads, a.dim);
      dout.fill_bytes(0xFF);  // poison (NaN): a row the kernel skips shows up in the check
      plan.run(dq.view(), dk.view(), dv.view(), dout.view(),
               opts);  // warm-up, and the output checked
      device_synchronize();
      for (std::int64_t i = 0; i < a.repeat; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        plan.run(dq.view(), dk.view(), dv.view(), dscratch.view(), opts);
        device_synchronize();  // wall time of one call, launch included
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      out = dout.to_host();
    } else {
      out.fill(std::nan(""));  // poison: a row the kernel skips shows up in the check
      plan.run(q.view(), k.view(), v.view(), out.view(), opts);  // warm-up, and the output checked
      for (std::int64_t i = 0; i < a.repeat; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        plan.run(q.view(), k.view(), v.view(), scratch.view(), opts);
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double flops = 4.0 * static_cast<double>(g.nnz()) * static_cast<double>(a.heads * a.dim);
  const auto in_b = static_cast<double>(size_of(in_t));
  const auto out_b = static_cast<double>(size_of(out_t));
  const auto hd = static_cast<double>(a.heads * a.dim);
  const double bytes = static_cast<double>(g.nnz()) * (2 * hd * in_b + 4) +
                       static_cast<double>(g.rows) * (hd * (in_b + out_b) + 8);

  // Check sampled rows against the float64 reference.
  double max_abs = 0, max_ref = 0;
  bool finite = true;
  std::int64_t checked = 0;
  {
    phase p("checking sampled rows against the float64 reference");
    std::vector<std::int64_t> rows;
    if (a.check_rows >= g.rows) {
      for (std::int64_t r = 0; r < g.rows; ++r) rows.push_back(r);
    } else {
      rng r(seed ^ 0xC0FFEEull);
      for (std::int64_t i = 0; i < a.check_rows; ++i)
        rows.push_back(static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(g.rows))));
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    }
    checked = static_cast<std::int64_t>(rows.size());
    const csr_graph sub = select_rows(g, rows);
    host_tensor qs(in_t, checked, a.heads, a.dim), ref(dtype::f64, checked, a.heads, a.dim);
    const std::int64_t w = a.heads * a.dim;
    for (std::int64_t i = 0; i < checked; ++i) {
      for (std::int64_t x = 0; x < w; ++x) qs.set(i * w + x, q.get(rows[i] * w + x));
    }
    reference::attention(sub, qs.view(), k.view(), v.view(), ref.view(),
                         effective_scale({.scale = a.scale}, a.dim));
    for (std::int64_t i = 0; i < checked; ++i) {
      for (std::int64_t x = 0; x < w; ++x) {
        const double o = out.get(rows[i] * w + x), r = ref.get(i * w + x);
        finite = finite && std::isfinite(o);
        max_abs = std::max(max_abs, std::abs(o - r));
        max_ref = std::max(max_ref, std::abs(r));
      }
    }
  }
  const double rel = max_abs / std::max(max_ref, 1e-300);
  // fp32 compute; the output rounding of a 16-bit out type dominates when there is one.
  // CPU: fp32 compute plus the output's rounding. CUDA: P is rounded to the input type before P·V.
  const double tol = where == device_kind::cuda
                         ? 1e-5 + 4 * (unit_roundoff(in_t) + unit_roundoff(out_t))
                         : 1e-5 + 2 * unit_roundoff(out_t);
  const bool pass = finite && rel <= tol;

  const nlohmann::json problem{{"graph", graph_name},
                               {"rows", g.rows},
                               {"cols", g.cols},
                               {"nnz", g.nnz()},
                               {"heads", a.heads},
                               {"dim", a.dim},
                               {"dtype", to_string(in_t)},
                               {"out_dtype", a.out_type},
                               {"scale", effective_scale({.scale = a.scale}, a.dim)},
                               {"algorithm", backend_name(plan.resolve(requested), where)}};

  if (!a.save.empty()) {
    phase p("saving pattern, Q, K, V and O to " + a.save);
    const std::filesystem::path dir(a.save);
    std::filesystem::create_directories(dir);
    const std::vector<std::int64_t> rp{static_cast<std::int64_t>(g.row_ptr.size())}, ci{g.nnz()};
    write_npy(dir / "row_ptr.npy", "<i8", rp, g.row_ptr.data(), 8 * g.row_ptr.size());
    write_npy(dir / "col_idx.npy", "<i4", ci, g.col_idx.data(), 4 * g.col_idx.size());
    save_tensor(dir / "q.npy", q);
    save_tensor(dir / "k.npy", k);
    save_tensor(dir / "v.npy", v);
    save_tensor(dir / "o.npy", out);
    nlohmann::json meta = problem;
    meta["formula"] = "o[i] = sum_j softmax_j(scale * q[i].k[j] for j in row i) v[j]";
    std::ofstream(dir / "meta.json") << meta.dump(2) << "\n";
  }

  nlohmann::json j = problem;
  j.update({{"device", to_string(where)},
            {"plan_build_s", plan.report().build_seconds},
            {"median_s", median},
            {"gflops", flops / median * 1e-9},
            {"gbps", bytes / median * 1e-9},
            {"checked_rows", checked},
            {"max_abs_error", max_abs},
            {"max_rel_error", rel},
            {"tolerance", tol},
            {"check", pass ? "pass" : "fail"}});
  if (a.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("graph      %s: %lld x %lld, %lld nonzeros\n", graph_name.c_str(),
                static_cast<long long>(g.rows), static_cast<long long>(g.cols),
                static_cast<long long>(g.nnz()));
    std::printf("problem    heads %lld, head_dim %lld, %s in, %s out\n",
                static_cast<long long>(a.heads), static_cast<long long>(a.dim),
                std::string(to_string(in_t)).c_str(), a.out_type.c_str());
    std::printf("backend    %s on %s (plan built in %.3f ms)\n",
                std::string(to_string(plan.resolve(requested))).c_str(), to_string(where),
                1e3 * plan.report().build_seconds);
    std::printf(
        "time       %.3f ms median of %lld   %.2f GFLOP/s   %.2f GB/s (gathers counted per edge)\n",
        1e3 * median, static_cast<long long>(a.repeat), flops / median * 1e-9,
        bytes / median * 1e-9);
    std::printf(
        "check      %lld sampled rows vs float64 reference: max abs error %.3g, max rel error %.3g "
        "(tolerance %.1g): %s\n",
        static_cast<long long>(checked), max_abs, rel, tol, pass ? "PASS" : "FAIL");
  }
  return pass ? 0 : 3;
}

}  // namespace

action add_run(CLI::App& app) {
  auto a = std::make_shared<run_args>();
  auto* cmd = app.add_subcommand(
      "run", "sparse attention on GRAPH (default: an embedded R-MAT graph), timed and checked");
  cmd->add_option("graph", a->path, "graph file; none = the embedded default");
  cmd->add_option("--dim", a->dim, "head dimension")->capture_default_str();
  cmd->add_option("--heads", a->heads, "heads")->capture_default_str();
  cmd->add_option("--dtype", a->type,
                  "Q/K/V dtype: f16, bf16, f32, f64 (auto: f16 on CUDA, f32 on the CPU)")
      ->capture_default_str();
  cmd->add_option("--device", a->device, "auto (CUDA when a device is visible), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--out-dtype", a->out_type, "output dtype")->capture_default_str();
  cmd->add_option("--scale", a->scale, "score scale (default 1/sqrt(dim))");
  cmd->add_option("--algo", a->algo, "automatic, fused, unfused (CUDA), blocked_reference (CPU)")
      ->capture_default_str();
  cmd->add_option("--repeat", a->repeat, "timed runs (median reported)")->capture_default_str();
  cmd->add_option("--check-rows", a->check_rows, "rows checked against the float64 reference")
      ->capture_default_str();
  cmd->add_option("--range", a->range, "Q/K/V distribution: signed = U[-1,1), unit = U[0,1)")
      ->check(CLI::IsMember({"signed", "unit"}))
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "seed for Q/K/V (0 = fresh each run)");
  cmd->add_option("--save", a->save,
                  "write row_ptr, col_idx, q, k, v, o (.npy) and meta.json to DIR");
  cmd->add_flag("--json", a->json, "print JSON");
  add_read_options(*cmd, a->read);
  return [a] { return run_run(*a); };
}

}  // namespace trisparse::cli
