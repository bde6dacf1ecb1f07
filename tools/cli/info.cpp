// trisparse info GRAPH: sizes, degrees, format statistics (Fused3S Tables 3, 6, 7) and footprints.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "commands.hpp"
#include "progress.hpp"
#include "trisparse/formats/bcsr.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/formats/me_bcrs.hpp"
#include "trisparse/formats/stats.hpp"

namespace trisparse::cli {

namespace {

struct info_args {
  std::string path;
  read_options read;
  bool json = false;
};

const std::map<std::string, symmetry> kSymmetry{{"auto", symmetry::automatic},
                                                {"as-stored", symmetry::as_stored},
                                                {"symmetrize", symmetry::symmetrize}};
const std::map<std::string, self_loops> kLoops{
    {"keep", self_loops::keep}, {"add", self_loops::add}, {"remove", self_loops::remove}};

nlohmann::json bsb_json(const bsb_stats& s) {
  nlohmann::json deciles = nlohmann::json::array();
  for (const auto& [lo, hi] : s.deciles) deciles.push_back({lo, hi});
  return {{"tcb", "16x" + std::to_string(s.tcb_cols)},
          {"windows", s.windows},
          {"tcbs", s.tcbs},
          {"tcb_per_window_mean", s.tcb_per_window_mean},
          {"tcb_per_window_cv", s.tcb_per_window_cv},
          {"nnz_per_tcb_mean", s.nnz_per_tcb_mean},
          {"nnz_per_tcb_cv", s.nnz_per_tcb_cv},
          {"max_tcbs_in_window", s.max_tcbs_in_window},
          {"deciles", deciles}};
}

// "x.graph_ptr.xz" -> "x"; "" when the name is not a graph pointer file.
std::string graph_ptr_stem(const std::string& path) {
  const std::size_t at = path.rfind(".graph_ptr");
  return at == std::string::npos ? "" : path.substr(0, at);
}

nlohmann::json batch_json(const std::vector<std::int64_t>& ptr) {
  std::int64_t lo = ptr.size() > 1 ? ptr[1] - ptr[0] : 0, hi = 0;
  for (std::size_t i = 1; i < ptr.size(); ++i) {
    lo = std::min(lo, ptr[i] - ptr[i - 1]);
    hi = std::max(hi, ptr[i] - ptr[i - 1]);
  }
  const auto graphs = static_cast<std::int64_t>(ptr.size()) - 1;
  return {{"graphs", graphs},
          {"nodes", ptr.back()},
          {"min_nodes", lo},
          {"max_nodes", hi},
          {"mean_nodes",
           graphs > 0 ? static_cast<double>(ptr.back()) / static_cast<double>(graphs) : 0.0}};
}

void print_batch(const nlohmann::json& b) {
  std::printf("  batch: %lld graphs, %lld nodes, nodes per graph min %lld  mean %.1f  max %lld\n",
              b["graphs"].get<long long>(), b["nodes"].get<long long>(),
              b["min_nodes"].get<long long>(), b["mean_nodes"].get<double>(),
              b["max_nodes"].get<long long>());
}

// A sibling "<stem>.graph_ptr[.xz|.gz]" of a graph file, if there is one.
std::optional<std::filesystem::path> sibling_graph_ptr(const std::string& path) {
  std::string stem = path;
  for (const char* ext : {".xz", ".gz"}) {
    if (stem.ends_with(ext)) stem.resize(stem.size() - 3);
  }
  const std::size_t dot = stem.rfind('.');
  if (dot != std::string::npos && stem.find('/', dot) == std::string::npos) stem.resize(dot);
  for (const char* ext : {".graph_ptr.xz", ".graph_ptr.gz", ".graph_ptr"}) {
    if (std::filesystem::exists(stem + ext)) return stem + ext;
  }
  return std::nullopt;
}

int run_info_graph_ptr(const info_args& a) {
  // Validate against the graph it belongs to when that file is beside it.
  std::int64_t nodes = -1;
  for (const char* ext : {".el.xz", ".el.gz", ".el"}) {
    const std::string graph = graph_ptr_stem(a.path) + ext;
    if (std::filesystem::exists(graph)) {
      nodes = read_edges(graph, a.read).edges.rows;
      break;
    }
  }
  phase p("reading " + a.path);
  const nlohmann::json b = batch_json(read_graph_ptr(a.path, nodes));
  if (a.json) {
    std::cout << nlohmann::json{{"file", a.path}, {"batch", b}}.dump(2) << "\n";
  } else {
    std::printf("%s (graph pointer%s)\n", a.path.c_str(),
                nodes >= 0 ? ", checked against its graph" : "");
    print_batch(b);
  }
  return 0;
}

int run_info(const info_args& a) {
  if (!graph_ptr_stem(a.path).empty()) return run_info_graph_ptr(a);
  const csr_graph g = load(a.path, a.read);
  nlohmann::json j;
  j["file"] = a.path;
  j["rows"] = g.rows;
  j["cols"] = g.cols;
  j["nnz"] = g.nnz();
  j["weighted"] = g.has_values();
  {
    const degree_stats d = compute_degree_stats(g);
    j["degree"] = {{"min", d.min},
                   {"max", d.max},
                   {"mean", d.mean},
                   {"stddev", d.stddev},
                   {"empty_rows", d.empty_rows},
                   {"self_loops", d.self_loops},
                   {"symmetric", d.symmetric}};
  }
  {
    phase p("building formats");
    for (const int c : {8, 16}) {
      const bsb f = build_bsb(g, c);
      auto s = bsb_json(compute_stats(f, g.nnz()));
      s["bytes"] = f.bytes();
      j["bsb"].push_back(s);
    }
    for (const int v : {8, 16}) {
      const me_bcrs m = build_me_bcrs(g, v, 8);
      j["me_bcrs"].push_back(
          {{"vector", std::to_string(v) + "x1"},
           {"vectors", m.vectors()},
           {"bytes", m.bytes()},
           {"sr_bcrs_bytes", m.sr_bcrs_bytes()},
           {"saving_vs_sr_bcrs",
            1.0 - static_cast<double>(m.bytes()) /
                      static_cast<double>(std::max<std::int64_t>(1, m.sr_bcrs_bytes()))}});
    }
    for (const std::int64_t b : {16, 64}) {
      // Block counts only: the values of a G = 64 BCSR of a large graph would take gigabytes.
      const bcsr f = build_bcsr(blocks_of(g, b));
      j["bcsr"].push_back(
          {{"block", b},
           {"blocks", f.blocks()},
           {"bytes", f.bytes() + f.blocks() * b * b * 4},
           {"fill", static_cast<double>(g.nnz()) /
                        static_cast<double>(std::max<std::int64_t>(1, f.blocks() * b * b))}});
    }
    for (const auto& fp : table3_footprints(g)) {
      j["table3_bytes"].push_back(
          {{"format", fp.format}, {"bytes", fp.bytes}, {"binary", fp.binary}});
    }
  }
  if (const auto ptr = sibling_graph_ptr(a.path))
    j["batch"] = batch_json(read_graph_ptr(*ptr, g.rows));
  if (a.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  const auto& d = j["degree"];
  std::printf("%s\n  %lld x %lld, %lld nonzeros%s\n", a.path.c_str(),
              static_cast<long long>(g.rows), static_cast<long long>(g.cols),
              static_cast<long long>(g.nnz()), g.has_values() ? " (weighted)" : "");
  std::printf(
      "  degree: min %lld  max %lld  mean %.2f  stddev %.2f  empty rows %lld  self loops %lld  "
      "%s\n",
      d["min"].get<long long>(), d["max"].get<long long>(), d["mean"].get<double>(),
      d["stddev"].get<double>(), d["empty_rows"].get<long long>(), d["self_loops"].get<long long>(),
      d["symmetric"].get<bool>() ? "symmetric" : "not symmetric");
  if (j.contains("batch")) print_batch(j["batch"]);
  std::printf(
      "\n  BSB (Fused3S Table 6/7)   windows      TCBs   TCB/RW (cv)      nnz/TCB (cv)   max "
      "TCB/RW       bytes\n");
  for (const auto& s : j["bsb"]) {
    std::printf("  %-24s %8lld %9lld  %6.2f (%.2f)    %6.2f (%.2f)   %10lld %11lld\n",
                s["tcb"].get<std::string>().c_str(), s["windows"].get<long long>(),
                s["tcbs"].get<long long>(), s["tcb_per_window_mean"].get<double>(),
                s["tcb_per_window_cv"].get<double>(), s["nnz_per_tcb_mean"].get<double>(),
                s["nnz_per_tcb_cv"].get<double>(), s["max_tcbs_in_window"].get<long long>(),
                s["bytes"].get<long long>());
  }
  std::printf("  TCB/RW deciles (16x8):");
  for (const auto& dd : j["bsb"][0]["deciles"])
    std::printf(" %lld-%lld", dd[0].get<long long>(), dd[1].get<long long>());
  std::printf("\n\n  ME-BCRS (FlashSparse)     vectors        bytes   SR-BCRS bytes   saving\n");
  for (const auto& m : j["me_bcrs"]) {
    std::printf("  %-24s %8lld %12lld %15lld   %5.1f%%\n", m["vector"].get<std::string>().c_str(),
                m["vectors"].get<long long>(), m["bytes"].get<long long>(),
                m["sr_bcrs_bytes"].get<long long>(), 100 * m["saving_vs_sr_bcrs"].get<double>());
  }
  std::printf("\n  BCSR                       blocks        bytes   fill\n");
  for (const auto& b : j["bcsr"]) {
    std::printf("  G = %-20lld %8lld %12lld   %.4f\n", b["block"].get<long long>(),
                b["blocks"].get<long long>(), b["bytes"].get<long long>(), b["fill"].get<double>());
  }
  std::printf("\n  footprint (Fused3S Table 3, r = 16, c = 8):");
  for (const auto& f : j["table3_bytes"]) {
    std::printf("  %s %.1f KiB", f["format"].get<std::string>().c_str(),
                static_cast<double>(f["bytes"].get<long long>()) / 1024.0);
  }
  std::printf("\n");
  return 0;
}

}  // namespace

void add_read_options(CLI::App& cmd, read_options& options) {
  cmd.add_option("--symmetry", options.sym, "auto: symmetrize files that say they are undirected")
      ->transform(CLI::CheckedTransformer(kSymmetry, CLI::ignore_case))
      ->default_str("auto");
  cmd.add_option("--self-loops", options.loops, "keep, add or remove self loops")
      ->transform(CLI::CheckedTransformer(kLoops, CLI::ignore_case))
      ->default_str("keep");
}

csr_graph load(const std::string& path, const read_options& options) {
  phase p("reading " + path);
  return read_graph(path, options);
}

action add_info(CLI::App& app) {
  auto args = std::make_shared<info_args>();
  auto* cmd =
      app.add_subcommand("info", "sizes, degree statistics, format statistics and footprints");
  cmd->add_option("graph", args->path, "graph file (edge list, .mtx, .npz, .npy, cache; .gz/.xz)")
      ->required();
  cmd->add_flag("--json", args->json, "print JSON");
  add_read_options(*cmd, args->read);
  return [args] { return run_info(*args); };
}

}  // namespace trisparse::cli
