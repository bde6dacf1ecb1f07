// trisparse convert IN OUT, and trisparse generate KIND OUT.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>

#include "commands.hpp"
#include "progress.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/graph/generate.hpp"

namespace trisparse::cli {

namespace {

// Writes by the output's extension: .mtx MatrixMarket, .el/.txt edge list, else the binary cache.
void write_by_extension(const csr_graph& g, const std::filesystem::path& out) {
  phase p("writing " + out.string());
  const std::string ext = out.extension().string();
  if (ext == ".mtx")
    write_matrix_market(g, out);
  else if (ext == ".el" || ext == ".txt")
    write_edge_list(g, out);
  else
    write_cache(g, out);
}

struct convert_args {
  std::string in, out;
  read_options read;
};

struct generate_args {
  std::string kind, out;
  std::int64_t n = 4096, window = 0, dilation = 1, globals = 0, random = 0, block = 64;
  std::int64_t graphs = 1024, min_nodes = 10, max_nodes = 40;
  int scale = 16;
  double edge_factor = 16, avg_degree = 8, p = 0.9;
  bool causal = false;
  std::uint64_t seed = 1;
};

int run_generate(const generate_args& a) {
  csr_graph g;
  {
    phase p("generating " + a.kind);
    if (a.kind == "rmat") {
      g = generate_rmat({.scale = a.scale, .edge_factor = a.edge_factor, .seed = a.seed});
    } else if (a.kind == "er") {
      g = generate_erdos_renyi({.rows = a.n, .avg_degree = a.avg_degree, .seed = a.seed});
    } else if (a.kind == "batch") {
      const batched_graph b = generate_batch({.graphs = a.graphs,
                                              .min_nodes = a.min_nodes,
                                              .max_nodes = a.max_nodes,
                                              .avg_degree = a.avg_degree,
                                              .seed = a.seed});
      g = b.graph;
      const std::filesystem::path ptr = a.out + ".graph_ptr";
      std::FILE* f = std::fopen(ptr.c_str(), "w");
      if (f == nullptr) throw error(ptr.string() + ": cannot open for writing");
      for (const auto x : b.graph_ptr) std::fprintf(f, "%lld\n", static_cast<long long>(x));
      std::fclose(f);
    } else if (a.kind == "mask") {
      g = generate_sequence_mask({.n = a.n,
                                  .window = a.window,
                                  .dilation = a.dilation,
                                  .global_tokens = a.globals,
                                  .random_per_row = a.random,
                                  .causal = a.causal,
                                  .seed = a.seed});
    } else if (a.kind == "block-random") {
      g = generate_block_random(
              {.n = a.n, .p = a.p, .block = a.block, .causal = a.causal, .seed = a.seed})
              .expand();
    } else {
      throw invalid_input("unknown generator '" + a.kind + "'");
    }
  }
  std::fprintf(stderr, "%lld x %lld, %lld nonzeros\n", static_cast<long long>(g.rows),
               static_cast<long long>(g.cols), static_cast<long long>(g.nnz()));
  write_by_extension(g, a.out);
  return 0;
}

}  // namespace

action add_convert(CLI::App& app) {
  auto args = std::make_shared<convert_args>();
  auto* cmd = app.add_subcommand(
      "convert", "read any graph file and write the binary cache (or .mtx/.el by extension)");
  cmd->add_option("input", args->in, "graph file")->required();
  cmd->add_option("output", args->out, "output file (.tsc cache; .mtx; .el)")->required();
  add_read_options(*cmd, args->read);
  return [args] {
    write_by_extension(load(args->in, args->read), args->out);
    return 0;
  };
}

action add_generate(CLI::App& app) {
  auto a = std::make_shared<generate_args>();
  auto* cmd = app.add_subcommand("generate", "write a generated pattern (seeded, deterministic)");
  cmd->add_option("kind", a->kind,
                  "rmat, er, batch, mask (window/dilated/global/BigBird/causal), block-random")
      ->required()
      ->check(CLI::IsMember({"rmat", "er", "batch", "mask", "block-random"}));
  cmd->add_option("output", a->out, "output file (.tsc cache; .mtx; .el)")->required();
  cmd->add_option("--scale", a->scale, "rmat: log2 of the node count")->capture_default_str();
  cmd->add_option("--edge-factor", a->edge_factor, "rmat: edges per node before symmetrization")
      ->capture_default_str();
  cmd->add_option("--n", a->n, "er, mask, block-random: node / token count")->capture_default_str();
  cmd->add_option("--avg-degree", a->avg_degree, "er, batch: average degree")
      ->capture_default_str();
  cmd->add_option("--graphs", a->graphs, "batch: number of graphs")->capture_default_str();
  cmd->add_option("--min-nodes", a->min_nodes, "batch: smallest graph")->capture_default_str();
  cmd->add_option("--max-nodes", a->max_nodes, "batch: largest graph")->capture_default_str();
  cmd->add_option("--window", a->window, "mask: keys within window * dilation")
      ->capture_default_str();
  cmd->add_option("--dilation", a->dilation, "mask: stride of the window")->capture_default_str();
  cmd->add_option("--globals", a->globals, "mask: global tokens")->capture_default_str();
  cmd->add_option("--random", a->random, "mask: random keys per query")->capture_default_str();
  cmd->add_option("--p", a->p, "block-random: fraction of blocks dropped")->capture_default_str();
  cmd->add_option("--block", a->block, "block-random: block size G")->capture_default_str();
  cmd->add_flag("--causal", a->causal, "mask, block-random: keep only keys <= query");
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  return [a] { return run_generate(*a); };
}

}  // namespace trisparse::cli
