// trisparse pattern init|learn|show: block-sparse attention patterns made from a graph or a
// layout, or learned from saved queries and keys (.npy through xtensor), written to and read from
// pattern files, described and drawn (PNG through libpng).
#include <png.h>

#include <charconv>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <xtensor/xarray.hpp>
#include <xtensor/xnpy.hpp>

#include "commands.hpp"
#include "progress.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/formats/block_pattern.hpp"
#include "trisparse/ops/pattern_learn.hpp"

namespace trisparse::cli {

namespace {

struct init_args {
  std::string graph, method = "community", out;
  read_options read;
  std::int64_t block = 64, heads = 1, n = 0, window = 1, stride = 8, globals = 1, random = 2;
  double sparsity = 0.9;
  std::uint64_t seed = 1;
};

struct learn_args {
  std::string q, k, v, out, method = "row";
  std::int64_t block = 64, window = 0, globals = 0;
  double sparsity = 0.9, top_p = 0.9;
  bool causal = false, no_diagonal = false;
};

struct show_args {
  std::string path, png;
  bool json = false;
  std::int64_t max_side = 1024, columns = 4;
};

void write_png(const gray_image& img, const std::string& path) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(img.width);
  image.height = static_cast<png_uint_32>(img.height);
  image.format = PNG_FORMAT_GRAY;
  if (png_image_write_to_file(&image, path.c_str(), 0, img.pixels.data(), 0, nullptr) == 0) {
    throw invalid_input(path + ": cannot write the PNG (" + image.message + ")");
  }
}

// Whether all of `text` reads as one number into x.
template <class T>
bool parses_as(const std::string& text, T& x) {
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, x);
  return ec == std::errc{} && p == end;
}

// Writes the pattern and says on stderr what it holds.
int save_and_report(const block_pattern& p, const std::string& out) {
  save_block_pattern(p, out);
  const block_pattern_stats s = stats(p);
  std::fprintf(stderr, "%lld heads, %lld x %lld blocks of %lld, density %.4f (head 0) -> %s\n",
               static_cast<long long>(p.num_heads()), static_cast<long long>(p.block_rows()),
               static_cast<long long>(p.block_cols()), static_cast<long long>(p.block),
               s.density[0], out.c_str());
  return 0;
}

int run_init(const init_args& a) {
  block_pattern p;
  if (a.method == "community") {
    if (a.graph.empty()) throw invalid_input("pattern init --method community needs GRAPH");
    const csr_graph g = load(a.graph, a.read);
    phase step("community order and blocks");
    p = community_block_pattern(g, a.block, a.heads, a.seed);
  } else {
    std::int64_t n = a.n;
    if (!a.graph.empty()) n = load(a.graph, a.read).rows;  // the layout over the graph's nodes
    if (n <= 0) throw invalid_input("pattern init --method " + a.method + " needs GRAPH or --n");
    block_layout_options o;
    o.block = a.block;
    o.p = a.sparsity;
    o.window = a.window;
    o.stride = a.stride;
    o.global = a.globals;
    o.random = a.random;
    o.seed = a.seed;
    if (a.method == "local-strided") {  // a band of blocks and every stride-th block
      o.layout = block_layout::window;
      const block_pattern local = layout_block_pattern(o, n, a.heads);
      o.layout = block_layout::strided;
      p = union_of({local, layout_block_pattern(o, n, a.heads)});
    } else {
      o.layout = a.method == "random"    ? block_layout::random
                 : a.method == "window"  ? block_layout::window
                 : a.method == "strided" ? block_layout::strided
                 : a.method == "global"  ? block_layout::global
                                         : block_layout::bigbird;
      p = layout_block_pattern(o, n, a.heads);
    }
  }
  return save_and_report(p, a.out);
}

// One .npy array of queries or keys: [N, D] (one head) or [H, N, D], float32 or float64, as f32
// [N, H, D]. @throws invalid_input naming the file for anything else (missing, truncated, another
// dtype or rank).
host_tensor load_samples(const std::string& path, const char* what) {
  const auto read = [&]<class T>() {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw invalid_input(path + ": cannot open the " + what + " file");
    xt::xarray<T> a = xt::load_npy<T>(in);
    if (!in || in.peek() != std::ifstream::traits_type::eof()) {
      throw invalid_input(path + ": truncated or with trailing bytes (a .npy of " +
                          std::to_string(a.size()) + " values expected)");
    }
    return xt::xarray<float>(xt::cast<float>(a));
  };
  xt::xarray<float> a;
  try {
    try {
      a = read.template operator()<float>();
    } catch (const std::runtime_error& e) {
      if (std::string(e.what()).find("Cast error") == std::string::npos) throw;
      a = read.template operator()<double>();
    }
  } catch (const invalid_input&) {
    throw;
  } catch (const std::exception& e) {
    throw invalid_input(path + ": not a float32 or float64 .npy array of " + what + " (" +
                        e.what() + ")");
  }
  if (a.dimension() == 2) a.reshape({std::size_t{1}, a.shape()[0], a.shape()[1]});
  if (a.dimension() != 3 || a.size() == 0) {
    throw invalid_input(path + ": " + what + " must be [N, D] or [H, N, D] with no empty side");
  }
  const auto heads = static_cast<std::int64_t>(a.shape()[0]);
  const auto n = static_cast<std::int64_t>(a.shape()[1]);
  const auto d = static_cast<std::int64_t>(a.shape()[2]);
  host_tensor t(dtype::f32, n, heads, d);
  auto* out = reinterpret_cast<float*>(t.data());
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t x = 0; x < d; ++x)
        out[(i * heads + h) * d + x] = a(static_cast<std::size_t>(h), static_cast<std::size_t>(i),
                                         static_cast<std::size_t>(x));
  return t;
}

int run_learn(const learn_args& a) {
  prune_options o;
  o.method = a.method == "topk" ? "row" : a.method;
  o.sparsity = a.sparsity;
  o.top_p = a.top_p;
  o.keep_diagonal = !a.no_diagonal;
  o.window = a.window;
  o.global_blocks = a.globals;
  o.check();
  if (o.method == "output" && a.v.empty()) {
    throw invalid_input("pattern learn --method output needs the values: --v V.npy");
  }
  host_tensor q, k, v;
  {
    phase step("reading queries and keys");
    q = load_samples(a.q, "queries");
    k = load_samples(a.k, "keys");
    if (o.method == "output") v = load_samples(a.v, "values");
  }
  if (k.view().heads != q.view().heads || k.view().dim != q.view().dim) {
    throw invalid_input(a.k + ": keys " + k.view().describe() + " do not match the queries " +
                        q.view().describe() + " of " + a.q + " (same H and D)");
  }
  std::optional<tensor_view> values;
  if (o.method == "output") {
    if (v.view().heads != k.view().heads || v.view().rows != k.view().rows) {
      throw invalid_input(a.v + ": values " + v.view().describe() + " do not match the keys " +
                          k.view().describe() + " of " + a.k + " (same H and N)");
    }
    values = v.view();
  }
  block_pattern p;
  {
    phase step(o.method == "output" ? "block masses, value sums and pruning"
                                    : "block masses and pruning");
    p = learn_block_pattern(q.view(), k.view(), a.block, o, a.causal, values);
  }
  return save_and_report(p, a.out);
}

int run_show(const show_args& a) {
  const block_pattern p = load_block_pattern(a.path);
  const block_pattern_stats s = stats(p);
  nlohmann::json j = {{"file", a.path},
                      {"heads", p.num_heads()},
                      {"rows", p.rows},
                      {"cols", p.cols},
                      {"block", p.block},
                      {"block_rows", p.block_rows()},
                      {"block_cols", p.block_cols()},
                      {"node_order", !p.order.empty()},
                      {"made_by", p.made_by},
                      {"density", s.density},
                      {"row_min_density", s.row_min_density},
                      {"row_max_density", s.row_max_density},
                      {"mean_distance", s.mean_distance},
                      {"head_overlap", s.head_overlap}};
  if (a.json) {
    std::cout << j.dump() << "\n";
  } else {
    std::printf("%s: %lld heads, %lld x %lld (%lld x %lld blocks of %lld)%s\n  made by: %s\n",
                a.path.c_str(), static_cast<long long>(p.num_heads()),
                static_cast<long long>(p.rows), static_cast<long long>(p.cols),
                static_cast<long long>(p.block_rows()), static_cast<long long>(p.block_cols()),
                static_cast<long long>(p.block), p.order.empty() ? "" : ", with a node order",
                p.made_by.c_str());
    for (std::int64_t h = 0; h < p.num_heads(); ++h) {
      const auto x = static_cast<std::size_t>(h);
      std::printf("  head %lld: density %.4f, block rows %.4f .. %.4f, mean distance %.4f\n",
                  static_cast<long long>(h), s.density[x], s.row_min_density[x],
                  s.row_max_density[x], s.mean_distance[x]);
    }
    std::printf("  head overlap (Jaccard): %.4f\n", s.head_overlap);
  }
  if (!a.png.empty()) write_png(render(p, a.max_side, a.columns), a.png);
  return 0;
}

}  // namespace

action add_pattern(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("pattern", "block-sparse attention patterns: make, learn, describe, draw");
  cmd->require_subcommand(1);
  // Sizes of at least 1, counts of at least 0, fractions of blocks in [0, 1) or (0, 1].
  const auto fraction = [](bool zero, bool one) {
    const std::string range = std::string(zero ? "[0" : "(0") + ", 1" + (one ? "]" : ")");
    return CLI::Validator(
        [=](const std::string& text) -> std::string {
          double x = 0.0;
          if (!parses_as(text, x) || !(zero ? x >= 0.0 : x > 0.0) || !(one ? x <= 1.0 : x < 1.0))
            return "must be a number in " + range + ", got " + text;
          return {};
        },
        "in " + range);
  };
  const auto at_least = [](std::int64_t low) {
    return CLI::Validator(
        [=](const std::string& text) -> std::string {
          std::int64_t x = 0;
          if (!parses_as(text, x) || x < low)
            return "must be a whole number >= " + std::to_string(low) + ", got " + text;
          return {};
        },
        ">= " + std::to_string(low));
  };
  const CLI::Validator positive = at_least(1), counts = at_least(0);
  auto init = std::make_shared<init_args>();
  auto* i = cmd->add_subcommand("init", "make a pattern from a graph's structure or a layout");
  i->add_option("graph", init->graph, "graph file (community; other methods: its node count)");
  i->add_option("--method", init->method, "how")
      ->check(CLI::IsMember(
          {"community", "random", "window", "strided", "global", "bigbird", "local-strided"}))
      ->capture_default_str();
  i->add_option("--block", init->block, "block size G")->check(positive)->capture_default_str();
  i->add_option("--heads", init->heads, "heads (random layouts draw per head)")
      ->check(positive)
      ->capture_default_str();
  i->add_option("--sparsity", init->sparsity, "random: fraction of blocks dropped")
      ->check(fraction(true, true))
      ->capture_default_str();
  i->add_option("--n", init->n, "nodes / tokens when no graph is given")
      ->check(counts)
      ->capture_default_str();
  i->add_option("--window", init->window, "window, bigbird, local-strided: band of blocks")
      ->check(counts)
      ->capture_default_str();
  i->add_option("--stride", init->stride, "strided, local-strided: stride in blocks")
      ->check(positive)
      ->capture_default_str();
  i->add_option("--globals", init->globals, "global, bigbird: global block rows and columns")
      ->check(counts)
      ->capture_default_str();
  i->add_option("--random", init->random, "bigbird: random key blocks a row")
      ->check(counts)
      ->capture_default_str();
  i->add_option("--seed", init->seed, "random seed")->capture_default_str();
  i->add_option("-o,--output", init->out, "pattern file to write")->required();
  add_read_options(*i, init->read);
  auto learn = std::make_shared<learn_args>();
  auto* l = cmd->add_subcommand(
      "learn", "learn a pattern from saved queries and keys (.npy, [N, D] or [H, N, D])");
  l->add_option("--q", learn->q, "queries (.npy, float32 or float64)")->required();
  l->add_option("--k", learn->k, "keys (.npy, the queries' H and D)")->required();
  l->add_option("--v", learn->v, "values (.npy, the keys' H and N; --method output)");
  l->add_option("--block", learn->block, "block size G")->check(positive)->capture_default_str();
  l->add_option("--sparsity", learn->sparsity, "fraction of blocks dropped (not threshold)")
      ->check(fraction(true, false))
      ->capture_default_str();
  l->add_option("--method", learn->method,
                "topk (= row: each block row's top blocks), global (each head's), threshold "
                "(each row's fewest blocks holding --top-p of its mass) or output (each block "
                "row's blocks that keep its attention output; needs --v)")
      ->check(CLI::IsMember({"topk", "row", "global", "threshold", "output"}))
      ->capture_default_str();
  l->add_option("--top-p", learn->top_p, "threshold: the mass each block row keeps")
      ->check(fraction(false, true))
      ->capture_default_str();
  l->add_flag("--causal", learn->causal, "keys up to each query's position only");
  l->add_flag("--no-diagonal", learn->no_diagonal, "do not force the diagonal blocks");
  l->add_option("--window", learn->window, "also force a band of blocks")
      ->check(counts)
      ->capture_default_str();
  l->add_option("--globals", learn->globals, "also force the first block rows and columns")
      ->check(counts)
      ->capture_default_str();
  l->add_option("-o,--output", learn->out, "pattern file to write")->required();
  auto show = std::make_shared<show_args>();
  auto* s = cmd->add_subcommand("show", "describe a pattern file, and draw it");
  s->add_option("file", show->path, "pattern file")->required();
  s->add_flag("--json", show->json, "one JSON object instead of text");
  s->add_option("--png", show->png, "also draw it: one panel per head");
  s->add_option("--max-side", show->max_side, "PNG: largest panel side in pixels")
      ->check(positive)
      ->capture_default_str();
  s->add_option("--columns", show->columns, "PNG: panels a row")
      ->check(positive)
      ->capture_default_str();
  return [init, learn, show, i, l, s] {
    if (i->parsed()) return run_init(*init);
    if (l->parsed()) return run_learn(*learn);
    if (s->parsed()) return run_show(*show);
    return 1;
  };
}

}  // namespace trisparse::cli
