// Format detection and dispatch, read_graph, and the text writers.
#include <cstring>
#include <fstream>

#include "readers.hpp"

namespace trisparse {

namespace {

// Replays a prefix that was read to detect the format, then continues with the source.
class prefixed_source final : public io::byte_source {
 public:
  prefixed_source(std::vector<std::byte> head, std::unique_ptr<io::byte_source> rest)
      : head_(std::move(head)), rest_(std::move(rest)) {}
  std::size_t read(std::byte* buffer, std::size_t n) override {
    if (pos_ < head_.size()) {
      const std::size_t k = std::min(n, head_.size() - pos_);
      std::memcpy(buffer, head_.data() + pos_, k);
      pos_ += k;
      return k;
    }
    return rest_->read(buffer, n);
  }

 private:
  std::vector<std::byte> head_;
  std::size_t pos_ = 0;
  std::unique_ptr<io::byte_source> rest_;
};

std::vector<std::byte> read_head(io::byte_source& src, std::size_t n) {
  std::vector<std::byte> head(n);
  std::size_t got = 0;
  while (got < n) {
    const std::size_t k = src.read(head.data() + got, n - got);
    if (k == 0) break;
    got += k;
  }
  head.resize(got);
  return head;
}

bool starts_with(const std::vector<std::byte>& head, std::string_view magic) {
  return head.size() >= magic.size() && std::memcmp(head.data(), magic.data(), magic.size()) == 0;
}

std::string extension_of(std::string_view name) {
  std::string n(name);
  for (const char* z : {".gz", ".xz"}) {
    if (n.size() > 3 && n.ends_with(z)) n.resize(n.size() - 3);
  }
  const std::size_t dot = n.rfind('.');
  return dot == std::string::npos ? "" : n.substr(dot);
}

file_format detect(const std::vector<std::byte>& head, std::string_view name) {
  if (starts_with(head, "PK\x03\x04") || starts_with(head, "PK\x05\x06")) return file_format::npz;
  if (starts_with(head, "\x93NUMPY")) return file_format::npy;
  if (starts_with(head, "TRSPARSE")) return file_format::cache;
  if (starts_with(head, "%%MatrixMarket") || starts_with(head, "%%matrixmarket")) {
    return file_format::matrix_market;
  }
  const std::string ext = extension_of(name);
  if (ext == ".mtx") return file_format::matrix_market;
  if (ext == ".npz") return file_format::npz;
  if (ext == ".npy") return file_format::npy;
  if (ext == ".tsc") return file_format::cache;
  return file_format::edge_list;
}

loaded_graph read_source(std::unique_ptr<io::byte_source> raw, const std::string& name,
                         const read_options& options) {
  std::vector<std::byte> head = read_head(*raw, 8);
  const io::compression c = io::detect_compression(head);
  std::unique_ptr<io::byte_source> src =
      std::make_unique<prefixed_source>(std::move(head), std::move(raw));
  src = io::decompress(std::move(src), c, name, options.max_bytes);
  std::vector<std::byte> text_head = read_head(*src, 16);
  if (text_head.empty()) io::fail(name, 0, "empty file");
  file_format f = options.format;
  if (f == file_format::automatic) f = detect(text_head, name);
  src = std::make_unique<prefixed_source>(std::move(text_head), std::move(src));
  switch (f) {
    case file_format::edge_list:
      return io::read_edge_list(*src, name);
    case file_format::matrix_market:
      return io::read_matrix_market(*src, name);
    case file_format::npy:
      return io::read_npy_edge_index(io::read_all(*src, name, options.max_bytes), name);
    case file_format::npz:
      return io::read_npz(io::read_all(*src, name, options.max_bytes), name, options.max_bytes);
    case file_format::cache: {
      loaded_graph g;
      g.edges = to_coo(io::read_cache_bytes(io::read_all(*src, name, options.max_bytes), name));
      g.info.format = file_format::cache;
      return g;
    }
    case file_format::automatic:
      break;
  }
  io::fail(name, 0, "unknown file format");
}

csr_graph finish(const loaded_graph& g, const read_options& options, const std::string& name) {
  // A few bytes can declare 2^31 nodes: bound the CSR before allocating it.
  const std::uint64_t csr_bytes =
      8 * (static_cast<std::uint64_t>(g.edges.rows) + 1) +
      12 * static_cast<std::uint64_t>(g.edges.nnz()) * (options.sym == symmetry::as_stored ? 1 : 2);
  if (csr_bytes > options.max_bytes) {
    io::fail(name, 0,
             std::to_string(g.edges.rows) + " nodes and " + std::to_string(g.edges.nnz()) +
                 " edges need about " + std::to_string(csr_bytes) +
                 " bytes as CSR, over the limit of " + std::to_string(options.max_bytes) +
                 " (read_options::max_bytes)");
  }
  build_options b;
  b.loops = options.loops;
  b.symmetrize = options.sym == symmetry::symmetrize ||
                 (options.sym == symmetry::automatic && g.info.directed == false);
  return to_csr(g.edges, b);
}

}  // namespace

loaded_graph read_edges(const std::filesystem::path& path, const read_options& options) {
  return read_source(io::open_file(path), path.string(), options);
}

loaded_graph read_edges_from_memory(std::span<const std::byte> bytes, std::string_view name,
                                    const read_options& options) {
  return read_source(io::open_memory(bytes), std::string(name), options);
}

csr_graph read_graph(const std::filesystem::path& path, const read_options& options) {
  return finish(read_edges(path, options), options, path.string());
}

csr_graph read_cache(const std::filesystem::path& path, const read_options& options) {
  auto raw = io::open_file(path);
  return io::read_cache_bytes(io::read_all(*raw, path.string(), options.max_bytes), path.string());
}

std::vector<std::int64_t> read_graph_ptr(const std::filesystem::path& path,
                                         std::int64_t num_nodes) {
  auto raw = io::open_file(path);
  std::vector<std::byte> head = read_head(*raw, 8);
  const io::compression c = io::detect_compression(head);
  std::unique_ptr<io::byte_source> src =
      std::make_unique<prefixed_source>(std::move(head), std::move(raw));
  src = io::decompress(std::move(src), c, path.string(), std::uint64_t{1} << 34);
  return io::read_graph_ptr(*src, path.string(), num_nodes);
}

void write_edge_list(const csr_graph& g, const std::filesystem::path& path) {
  std::ofstream f(path);
  if (!f) throw error(path.string() + ": cannot open for writing");
  f.precision(9);
  f << "# written by trisparse\n# nodes: " << std::max(g.rows, g.cols) << " edges: " << g.nnz()
    << " directed: yes\n";
  for (std::int64_t r = 0; r < g.rows; ++r) {
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      f << r << ' ' << g.col_idx[e];
      if (g.has_values()) f << ' ' << g.values[e];
      f << '\n';
    }
  }
  if (!f) throw error(path.string() + ": write failed");
}

void write_matrix_market(const csr_graph& g, const std::filesystem::path& path) {
  std::ofstream f(path);
  if (!f) throw error(path.string() + ": cannot open for writing");
  f.precision(9);
  f << "%%MatrixMarket matrix coordinate " << (g.has_values() ? "real" : "pattern")
    << " general\n% written by trisparse\n"
    << g.rows << ' ' << g.cols << ' ' << g.nnz() << '\n';
  for (std::int64_t r = 0; r < g.rows; ++r) {
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      f << r + 1 << ' ' << g.col_idx[e] + 1;
      if (g.has_values()) f << ' ' << g.values[e];
      f << '\n';
    }
  }
  if (!f) throw error(path.string() + ": write failed");
}

std::string_view to_string(file_format f) {
  switch (f) {
    case file_format::automatic:
      return "automatic";
    case file_format::edge_list:
      return "edge_list";
    case file_format::matrix_market:
      return "matrix_market";
    case file_format::npz:
      return "npz";
    case file_format::npy:
      return "npy";
    case file_format::cache:
      return "cache";
  }
  return "?";
}

file_format parse_file_format(std::string_view name) {
  for (const auto f : {file_format::automatic, file_format::edge_list, file_format::matrix_market,
                       file_format::npz, file_format::npy, file_format::cache}) {
    if (to_string(f) == name) return f;
  }
  if (name == "mtx") return file_format::matrix_market;
  if (name == "el" || name == "txt") return file_format::edge_list;
  throw invalid_input("unknown file format '" + std::string(name) + "'");
}

}  // namespace trisparse
