// block_pattern: checks, statistics, conversions and its file format.
#include "trisparse/formats/block_pattern.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string_view>

#include "trisparse/core/error.hpp"
#include "trisparse/formats/bcsr.hpp"
#include "trisparse/graph/reorder.hpp"

namespace trisparse {

namespace {

static_assert(std::endian::native == std::endian::little, "the pattern file is little-endian");

constexpr char kMagic[8] = {'T', 'S', 'B', 'P', 'A', 'T', 'T', '\0'};
constexpr std::uint32_t kVersion = 1;
// Bounds that keep the block counts' arithmetic exact (far beyond any pattern's).
constexpr std::int64_t kMaxBlock = std::int64_t{1} << 20, kMaxSide = std::int64_t{1} << 40;

// 64-bit FNV-1a over the bytes.
std::uint64_t fnv1a(std::span<const char> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

struct writer {
  std::vector<char> out;
  template <class T>
  void put(const T& x) {
    const char* p = reinterpret_cast<const char*>(&x);
    out.insert(out.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_all(const std::vector<T>& xs) {
    const char* p = reinterpret_cast<const char*>(xs.data());
    out.insert(out.end(), p, p + xs.size() * sizeof(T));
  }
};

// Reads fields in order; any read past the payload's end fails naming the file as truncated.
struct reader {
  std::span<const char> in;
  const std::string& name;
  std::size_t at = 0;

  void need(std::size_t bytes, const char* what) const {
    if (bytes > in.size() - at) {
      throw invalid_input(name + ": truncated (it ends inside " + what + ")");
    }
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T x;
    std::memcpy(&x, in.data() + at, sizeof(T));
    at += sizeof(T);
    return x;
  }
  template <class T>
  std::vector<T> get_all(std::int64_t count, const char* what) {
    if (count < 0) throw invalid_input(name + ": negative count of " + what);
    const auto n = static_cast<std::size_t>(count);
    if (n > (in.size() - at) / sizeof(T)) {
      throw invalid_input(name + ": truncated (it ends inside " + what + ")");
    }
    std::vector<T> xs(n);
    if (n > 0) std::memcpy(xs.data(), in.data() + at, n * sizeof(T));
    at += n * sizeof(T);
    return xs;
  }
};

}  // namespace

void block_pattern::check() const {
  TRISPARSE_EXPECTS_INPUT(block >= 1,
                          "block_pattern: block must be >= 1, not " + std::to_string(block));
  TRISPARSE_EXPECTS_INPUT(block <= kMaxBlock, "block_pattern: block above 2^20");
  TRISPARSE_EXPECTS_INPUT(rows >= 0 && cols >= 0 && rows <= kMaxSide && cols <= kMaxSide,
                          "block_pattern: rows and cols must be in [0, 2^40]");
  TRISPARSE_EXPECTS_INPUT(!heads.empty(), "block_pattern: no heads");
  for (std::size_t h = 0; h < heads.size(); ++h) {
    const csr_graph& g = heads[h];
    const std::string head = "block_pattern head " + std::to_string(h);
    TRISPARSE_EXPECTS_INPUT(
        g.rows == block_rows() && g.cols == block_cols(),
        head + " is " + std::to_string(g.rows) + " x " + std::to_string(g.cols) + " blocks, not " +
            std::to_string(block_rows()) + " x " + std::to_string(block_cols()));
    try {
      g.check();  // key blocks in range, ascending and unique per block row
    } catch (const invalid_input& e) {
      throw invalid_input(head + ": " + e.what());
    }
  }
  if (!order.empty()) {
    TRISPARSE_EXPECTS_INPUT(rows == cols, "block_pattern: a node order needs a square pattern");
    TRISPARSE_EXPECTS_INPUT(static_cast<std::int64_t>(order.size()) == rows,
                            "block_pattern: the order has " + std::to_string(order.size()) +
                                " entries for " + std::to_string(rows) + " rows");
    std::vector<char> seen(order.size(), 0);
    for (const std::int64_t x : order) {
      TRISPARSE_EXPECTS_INPUT(x >= 0 && x < rows && !seen[static_cast<std::size_t>(x)],
                              "block_pattern: the order is not a permutation of 0 .. rows - 1");
      seen[static_cast<std::size_t>(x)] = 1;
    }
  }
}

block_sparse_mask block_pattern::to_mask(bool causal) const {
  check();
  block_sparse_mask m;
  m.block = block;
  m.heads = num_heads();
  m.causal = causal;
  m.cu_seqlens_q = {0, rows};
  m.cu_seqlens_k = {0, cols};
  for (const csr_graph& g : heads) m.masks.push_back({rows, cols, block, g});
  return m;
}

block_pattern_stats stats(const block_pattern& p) {
  p.check();
  block_pattern_stats s;
  const double br = static_cast<double>(p.block_rows()), bc = static_cast<double>(p.block_cols());
  for (const csr_graph& g : p.heads) {
    const double all = br * bc;
    s.density.push_back(all > 0 ? static_cast<double>(g.nnz()) / all : 0.0);
    double lo = g.rows > 0 ? 1.0 : 0.0, hi = 0.0, distance = 0.0;
    for (std::int64_t r = 0; r < g.rows; ++r) {
      const double d = bc > 0 ? static_cast<double>(g.degree(r)) / bc : 0.0;
      lo = std::min(lo, d);
      hi = std::max(hi, d);
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e)
        distance += std::abs(static_cast<double>(g.col_idx[e]) - static_cast<double>(r));
    }
    s.row_min_density.push_back(lo);
    s.row_max_density.push_back(hi);
    s.mean_distance.push_back(g.nnz() > 0 && br > 0 ? distance / static_cast<double>(g.nnz()) / br
                                                    : 0.0);
  }
  // Jaccard overlap of every head pair: merge their sorted rows.
  double total = 0.0;
  std::int64_t pairs = 0;
  for (std::size_t a = 0; a < p.heads.size(); ++a) {
    for (std::size_t b = a + 1; b < p.heads.size(); ++b) {
      const csr_graph &x = p.heads[a], &y = p.heads[b];
      std::int64_t both = 0;
      for (std::int64_t r = 0; r < x.rows; ++r) {
        const auto xs = std::span(x.col_idx).subspan(x.row_ptr[r], x.degree(r));
        const auto ys = std::span(y.col_idx).subspan(y.row_ptr[r], y.degree(r));
        std::vector<std::int32_t> common;
        std::ranges::set_intersection(xs, ys, std::back_inserter(common));
        both += static_cast<std::int64_t>(common.size());
      }
      const std::int64_t either = x.nnz() + y.nnz() - both;
      total += either > 0 ? static_cast<double>(both) / static_cast<double>(either) : 1.0;
      ++pairs;
    }
  }
  s.head_overlap = pairs > 0 ? total / static_cast<double>(pairs) : 1.0;
  return s;
}

gray_image render(const block_pattern& p, std::int64_t max_side, std::int64_t columns) {
  p.check();
  TRISPARSE_EXPECTS_INPUT(max_side >= 1 && columns >= 1, "render: max_side and columns >= 1");
  const std::int64_t qb = p.block_rows(), kb = p.block_cols();
  const std::int64_t cell = std::max<std::int64_t>(1, (std::max(qb, kb) + max_side - 1) / max_side);
  const std::int64_t up =
      cell == 1 ? std::max<std::int64_t>(1, 256 / std::max<std::int64_t>({qb, kb, 1})) : 1;
  const std::int64_t gh = (qb + cell - 1) / cell, gw = (kb + cell - 1) / cell;
  const std::int64_t ph = gh * up, pw = gw * up, gap = 4;
  const std::int64_t per_row = std::min(columns, p.num_heads());
  const std::int64_t panel_rows = (p.num_heads() + per_row - 1) / per_row;
  gray_image img;
  img.width = per_row * (pw + gap) - gap;
  img.height = panel_rows * (ph + gap) - gap;
  img.pixels.assign(static_cast<std::size_t>(img.width * img.height), 255);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(gh * gw));
  for (std::int64_t h = 0; h < p.num_heads(); ++h) {
    const csr_graph& g = p.heads[static_cast<std::size_t>(h)];
    std::fill(counts.begin(), counts.end(), 0);
    for (std::int64_t r = 0; r < g.rows; ++r)
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e)
        ++counts[static_cast<std::size_t>((r / cell) * gw + g.col_idx[e] / cell)];
    const std::int64_t y0 = (h / per_row) * (ph + gap), x0 = (h % per_row) * (pw + gap);
    for (std::int64_t y = 0; y < ph; ++y) {
      for (std::int64_t x = 0; x < pw; ++x) {
        const double share =
            static_cast<double>(counts[static_cast<std::size_t>((y / up) * gw + x / up)]) /
            static_cast<double>(cell * cell);
        img.pixels[static_cast<std::size_t>((y0 + y) * img.width + x0 + x)] =
            static_cast<std::uint8_t>(std::lround(255.0 * (1.0 - std::min(share, 1.0))));
      }
    }
  }
  return img;
}

block_pattern make_block_pattern(std::vector<block_mask> masks, std::string made_by) {
  TRISPARSE_EXPECTS_INPUT(!masks.empty(), "make_block_pattern: no masks");
  block_pattern p;
  p.block = masks[0].block;
  p.rows = masks[0].rows;
  p.cols = masks[0].cols;
  p.made_by = std::move(made_by);
  for (block_mask& m : masks) {
    TRISPARSE_EXPECTS_INPUT(m.block == p.block && m.rows == p.rows && m.cols == p.cols,
                            "make_block_pattern: the masks differ in shape or block");
    p.heads.push_back(std::move(m.blocks));
  }
  p.check();
  return p;
}

block_pattern layout_block_pattern(const block_layout_options& options, std::int64_t n,
                                   std::int64_t heads) {
  TRISPARSE_EXPECTS_INPUT(heads >= 1, "layout_block_pattern: heads must be >= 1");
  block_layout_options o = options;
  o.heads = heads;
  const std::int64_t lens[] = {n};
  block_sparse_mask m = make_block_sparse_mask(o, lens);
  std::vector<block_mask> masks;
  for (std::int64_t h = 0; h < heads; ++h) masks.push_back(m.at(0, h));
  static constexpr std::string_view names[] = {"dense",   "random", "window",
                                               "strided", "global", "bigbird"};
  std::string made_by = "layout " + std::string(names[static_cast<int>(o.layout)]) +
                        " block=" + std::to_string(o.block) + " p=" + std::to_string(o.p) +
                        " window=" + std::to_string(o.window) +
                        " stride=" + std::to_string(o.stride) +
                        " global=" + std::to_string(o.global) +
                        " random=" + std::to_string(o.random) + " seed=" + std::to_string(o.seed);
  return make_block_pattern(std::move(masks), std::move(made_by));
}

block_pattern community_block_pattern(const csr_graph& g, std::int64_t block, std::int64_t heads,
                                      std::uint64_t seed) {
  TRISPARSE_EXPECTS_INPUT(g.rows == g.cols, "community_block_pattern needs a square graph");
  TRISPARSE_EXPECTS_INPUT(block >= 1 && heads >= 1,
                          "community_block_pattern: block and heads must be >= 1");
  block_pattern p;
  p.block = block;
  p.rows = p.cols = g.rows;
  p.order = community_order(g, seed);
  std::vector<std::int64_t> where(p.order.size());
  for (std::size_t i = 0; i < p.order.size(); ++i)
    where[static_cast<std::size_t>(p.order[i])] = static_cast<std::int64_t>(i);
  coo_graph c = to_coo(g);
  c.values.clear();
  for (std::int64_t e = 0; e < c.nnz(); ++e) {
    c.src[static_cast<std::size_t>(e)] =
        where[static_cast<std::size_t>(c.src[static_cast<std::size_t>(e)])];
    c.dst[static_cast<std::size_t>(e)] =
        where[static_cast<std::size_t>(c.dst[static_cast<std::size_t>(e)])];
  }
  build_options loops;
  loops.loops = self_loops::add;
  const block_mask blocks = blocks_of(to_csr(c, loops), block);
  p.heads.assign(static_cast<std::size_t>(heads), blocks.blocks);
  p.made_by = "community(label propagation, seed=" + std::to_string(seed) + ") of a graph of " +
              std::to_string(g.rows) + " nodes, " + std::to_string(g.nnz()) +
              " edges; block=" + std::to_string(block);
  p.check();
  return p;
}

block_pattern union_of(const std::vector<block_pattern>& patterns) {
  TRISPARSE_EXPECTS_INPUT(!patterns.empty(), "union_of: no patterns");
  const block_pattern& first = patterns[0];
  std::int64_t heads = 1;
  std::string made_by = "union of";
  for (const block_pattern& p : patterns) {
    p.check();
    TRISPARSE_EXPECTS_INPUT(p.block == first.block && p.rows == first.rows &&
                                p.cols == first.cols && p.order == first.order,
                            "union_of: the patterns differ in shape, block or node order");
    TRISPARSE_EXPECTS_INPUT(p.num_heads() == 1 || heads == 1 || p.num_heads() == heads,
                            "union_of: the patterns have " + std::to_string(heads) + " and " +
                                std::to_string(p.num_heads()) + " heads");
    heads = std::max(heads, p.num_heads());
    made_by += " [" + p.made_by + "]";
  }
  block_pattern out;
  out.block = first.block;
  out.rows = first.rows;
  out.cols = first.cols;
  out.order = first.order;
  out.made_by = std::move(made_by);
  for (std::int64_t h = 0; h < heads; ++h) {
    csr_graph g;
    g.rows = first.block_rows();
    g.cols = first.block_cols();
    for (std::int64_t r = 0; r < g.rows; ++r) {
      std::vector<std::int32_t> row;
      for (const block_pattern& p : patterns) {
        const csr_graph& x = p.heads[static_cast<std::size_t>(p.num_heads() == 1 ? 0 : h)];
        row.insert(row.end(), x.col_idx.begin() + x.row_ptr[r],
                   x.col_idx.begin() + x.row_ptr[r + 1]);
      }
      std::ranges::sort(row);
      row.erase(std::unique(row.begin(), row.end()), row.end());
      g.col_idx.insert(g.col_idx.end(), row.begin(), row.end());
      g.row_ptr.push_back(static_cast<std::int64_t>(g.col_idx.size()));
    }
    out.heads.push_back(std::move(g));
  }
  return out;
}

void save_block_pattern(const block_pattern& p, const std::filesystem::path& path) {
  p.check();
  writer w;
  w.out.insert(w.out.end(), std::begin(kMagic), std::end(kMagic));
  w.put(kVersion);
  for (const std::int64_t x :
       {p.block, p.rows, p.cols, p.num_heads(), static_cast<std::int64_t>(p.order.size())})
    w.put(x);
  w.put(static_cast<std::uint64_t>(p.made_by.size()));
  w.out.insert(w.out.end(), p.made_by.begin(), p.made_by.end());
  w.put_all(p.order);
  for (const csr_graph& g : p.heads) {
    w.put(g.nnz());
    w.put_all(g.row_ptr);
    w.put_all(g.col_idx);
  }
  w.put(fnv1a(w.out));
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(w.out.data(), static_cast<std::streamsize>(w.out.size()));
  f.close();
  TRISPARSE_EXPECTS_INPUT(f.good(), path.string() + ": cannot write the pattern file");
}

block_pattern load_block_pattern(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw invalid_input(name + ": is a directory, not a pattern file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw invalid_input(name + ": cannot open the pattern file");
  std::vector<char> bytes;
  try {  // (libstdc++'s filebuf throws on a read error, whatever the stream's exception mask)
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw invalid_input(name + ": cannot read the pattern file (" + e.what() + ")");
  }
  return parse_block_pattern(bytes, name);
}

block_pattern parse_block_pattern(std::span<const char> bytes, const std::string& name) {
  if (bytes.size() < sizeof(kMagic) ||
      !std::equal(std::begin(kMagic), std::end(kMagic), bytes.begin()))
    throw invalid_input(name + ": not a trisparse pattern file (no TSBPATT magic)");
  if (bytes.size() < sizeof(kMagic) + sizeof(kVersion) + sizeof(std::uint64_t))
    throw invalid_input(name + ": truncated (no header)");
  reader in{bytes.first(bytes.size() - sizeof(std::uint64_t)), name};
  in.at = sizeof(kMagic);
  const auto version = in.get<std::uint32_t>("the version");
  if (version != kVersion) {
    throw invalid_input(name + ": pattern file version " + std::to_string(version) +
                        "; this build reads version " + std::to_string(kVersion));
  }
  const auto parse = [&] {
    in.at = sizeof(kMagic) + sizeof(kVersion);
    block_pattern p;
    p.block = in.get<std::int64_t>("the header");
    p.rows = in.get<std::int64_t>("the header");
    p.cols = in.get<std::int64_t>("the header");
    const auto heads = in.get<std::int64_t>("the header");
    const auto order = in.get<std::int64_t>("the header");
    const auto made_by = in.get<std::uint64_t>("the header");
    const std::vector<char> text = in.get_all<char>(static_cast<std::int64_t>(made_by), "made_by");
    p.made_by.assign(text.begin(), text.end());
    p.order = in.get_all<std::int64_t>(order, "the node order");
    if (p.block < 1 || p.block > kMaxBlock || p.rows < 0 || p.cols < 0 || p.rows > kMaxSide ||
        p.cols > kMaxSide || heads < 1)
      throw invalid_input(name + ": a broken header (block, sizes or heads)");
    for (std::int64_t h = 0; h < heads; ++h) {
      csr_graph g;
      g.rows = p.block_rows();
      g.cols = p.block_cols();
      const auto nnz = in.get<std::int64_t>("a head's block count");
      g.row_ptr = in.get_all<std::int64_t>(g.rows + 1, "a head's block rows");
      g.col_idx = in.get_all<std::int32_t>(nnz, "a head's key blocks");
      p.heads.push_back(std::move(g));
    }
    if (in.at != in.in.size()) throw invalid_input(name + ": bytes after the last head");
    return p;
  };
  std::uint64_t sum;
  std::memcpy(&sum, bytes.data() + bytes.size() - sizeof(sum), sizeof(sum));
  if (sum != fnv1a(in.in)) {
    try {
      parse();  // a cut file reads as truncated; anything else as damaged
    } catch (const invalid_input& e) {
      if (std::string_view(e.what()).find("truncated") != std::string_view::npos) throw;
    }
    throw invalid_input(name + ": checksum mismatch (a damaged file)");
  }
  block_pattern p = parse();
  try {
    p.check();
  } catch (const invalid_input& e) {
    throw invalid_input(name + ": " + e.what());
  }
  return p;
}

}  // namespace trisparse
