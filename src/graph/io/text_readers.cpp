// Edge lists (SNAP style) and MatrixMarket coordinate files.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <string>

#include "readers.hpp"

namespace trisparse::io {

namespace {

constexpr std::int64_t kMaxId = std::numeric_limits<std::int32_t>::max() - 1;

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Finds "key:" (case-insensitive) in a comment and parses the integer after it.
bool header_int(const std::string& lowered, std::string_view key, const line_reader& lines,
                std::int64_t& out) {
  const std::size_t at = lowered.find(std::string(key) + ":");
  if (at == std::string::npos) return false;
  std::size_t i = at + key.size() + 1;
  while (i < lowered.size() && lowered[i] == ' ') ++i;
  std::size_t j = i;
  while (j < lowered.size() && !std::isspace(static_cast<unsigned char>(lowered[j]))) ++j;
  if (!parse_int(std::string_view(lowered).substr(i, j - i), out) || out < 0) {
    lines.fail("header field '" + std::string(key) + "' is not a non-negative integer");
  }
  return true;
}

std::int64_t parse_id(std::string_view token, const line_reader& lines, int column) {
  std::int64_t v = 0;
  if (!parse_int(token, v)) {
    lines.fail("non-numeric token '" + std::string(token.substr(0, 40)) + "' in column " +
               std::to_string(column));
  }
  if (v < 0)
    lines.fail("negative node id " + std::to_string(v) + " in column " + std::to_string(column));
  return v;
}

}  // namespace

loaded_graph read_edge_list(byte_source& src, const std::string& name) {
  line_reader lines(src, name);
  loaded_graph out;
  out.info.format = file_format::edge_list;
  std::int64_t header_line = 0, max_id = -1;
  int columns = 0;
  bool any_line = false;
  std::string_view line;
  std::string_view tok[4];
  while (lines.next(line)) {
    any_line = true;
    const std::string_view t = trim(line);
    if (t.empty()) continue;
    if (t.front() == '#' || t.front() == '%') {
      // A header line starts with one of its keys ("# nodes: N edges: M directed: no", SNAP's
      // "# Nodes: N Edges: M"); any other comment is free text.
      const std::string lowered = lower(trim(t.substr(1)));
      const bool header = lowered.starts_with("nodes:") || lowered.starts_with("edges:") ||
                          lowered.starts_with("directed:") || lowered.starts_with("graphs:");
      if (!header) {
        if (out.info.description.empty()) out.info.description = std::string(trim(t.substr(1)));
        continue;
      }
      std::int64_t v = 0;
      if (header_int(lowered, "nodes", lines, v)) {
        if (v > kMaxId + 1)
          lines.fail("header declares " + std::to_string(v) + " nodes, more than 32-bit ids allow");
        out.info.declared_nodes = v;
        header_line = lines.line_number();
      }
      if (header_int(lowered, "edges", lines, v)) {
        out.info.declared_edges = v;
        header_line = lines.line_number();
      }
      const std::size_t d = lowered.find("directed:");
      if (d != std::string::npos) {
        const std::string_view rest = trim(std::string_view(lowered).substr(d + 9));
        if (rest.starts_with("yes"))
          out.info.directed = true;
        else if (rest.starts_with("no"))
          out.info.directed = false;
        else
          lines.fail("header field 'directed' must be yes or no");
      }
      continue;
    }
    const std::size_t n = tokenize(t, tok, 4);
    if (n < 2 || n > 3) {
      lines.fail("expected 'src dst' or 'src dst weight', found " + std::to_string(n) + " field" +
                 (n == 1 ? "" : "s"));
    }
    if (columns == 0) columns = static_cast<int>(n);
    if (static_cast<int>(n) != columns) {
      lines.fail("line has " + std::to_string(n) + " fields but earlier lines have " +
                 std::to_string(columns));
    }
    const std::int64_t s = parse_id(tok[0], lines, 1), d = parse_id(tok[1], lines, 2);
    for (const std::int64_t id : {s, d}) {
      if (out.info.declared_nodes && id >= *out.info.declared_nodes) {
        lines.fail("node id " + std::to_string(id) + " out of range: the header declares " +
                   std::to_string(*out.info.declared_nodes) + " nodes");
      }
      if (id > kMaxId)
        lines.fail("node id " + std::to_string(id) + " exceeds the 32-bit index range");
    }
    if (n == 3) {
      double w = 0;
      if (!parse_float(tok[2], w))
        lines.fail("non-numeric or non-finite weight '" + std::string(tok[2].substr(0, 40)) + "'");
      if (std::abs(w) > std::numeric_limits<float>::max()) lines.fail("weight overflows float32");
      out.edges.values.push_back(static_cast<float>(w));
    }
    out.edges.src.push_back(s);
    out.edges.dst.push_back(d);
    max_id = std::max({max_id, s, d});
  }
  if (!any_line) fail(name, 0, "empty file");
  if (out.edges.src.empty() && !out.info.declared_nodes) {
    fail(name, lines.line_number(), "no edges and no '# nodes:' header");
  }
  if (out.info.declared_edges && *out.info.declared_edges != out.edges.nnz()) {
    fail(name, header_line,
         "header declares " + std::to_string(*out.info.declared_edges) +
             " edges but the file has " + std::to_string(out.edges.nnz()) + " (truncated?)");
  }
  const std::int64_t n = out.info.declared_nodes.value_or(max_id + 1);
  out.edges.rows = out.edges.cols = n;
  return out;
}

loaded_graph read_matrix_market(byte_source& src, const std::string& name) {
  line_reader lines(src, name);
  loaded_graph out;
  out.info.format = file_format::matrix_market;
  std::string_view line;
  if (!lines.next(line)) fail(name, 0, "empty file");
  std::string_view tok[6];
  const std::string banner = lower(trim(line));
  if (tokenize(banner, tok, 6) != 5 || tok[0] != "%%matrixmarket") {
    lines.fail("expected '%%MatrixMarket matrix coordinate <field> <symmetry>'");
  }
  if (tok[1] != "matrix")
    lines.fail("object '" + std::string(tok[1]) + "' is not supported (only 'matrix')");
  if (tok[2] != "coordinate")
    lines.fail("format '" + std::string(tok[2]) + "' is not supported (only 'coordinate')");
  const std::string field(tok[3]), sym(tok[4]);
  if (field != "pattern" && field != "real" && field != "integer") {
    lines.fail("field '" + field + "' is not supported (pattern, real or integer)");
  }
  if (sym != "general" && sym != "symmetric") {
    lines.fail("symmetry '" + sym + "' is not supported (general or symmetric)");
  }
  const bool weighted = field != "pattern", symmetric = sym == "symmetric";
  out.info.directed = !symmetric;
  // Size line after comments.
  std::int64_t rows = -1, cols = -1, nnz = -1;
  while (lines.next(line)) {
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '%') continue;
    if (tokenize(t, tok, 6) != 3 || !parse_int(tok[0], rows) || !parse_int(tok[1], cols) ||
        !parse_int(tok[2], nnz)) {
      lines.fail("expected the size line 'rows cols entries'");
    }
    if (rows < 0 || cols < 0 || nnz < 0) lines.fail("negative size in the size line");
    if (rows > kMaxId + 1 || cols > kMaxId + 1)
      lines.fail("matrix dimensions exceed the 32-bit index range");
    if (symmetric && rows != cols) lines.fail("a symmetric matrix must be square");
    if (rows > 0 && cols > 0 && nnz / rows > cols)
      lines.fail("more entries declared than the matrix has cells");
    break;
  }
  if (rows < 0) lines.fail("missing size line");
  const std::int64_t size_line = lines.line_number();
  out.info.declared_nodes = rows;
  out.info.declared_edges = nnz;
  const std::size_t expect = weighted ? 3 : 2;
  std::int64_t seen = 0;
  const std::size_t reserve = static_cast<std::size_t>(std::min<std::int64_t>(nnz, 1 << 20));
  out.edges.src.reserve(reserve);
  out.edges.dst.reserve(reserve);
  while (lines.next(line)) {
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '%') continue;
    const std::size_t n = tokenize(t, tok, 6);
    if (n != expect) {
      lines.fail("expected " + std::to_string(expect) + " fields for a " + field +
                 " matrix, found " + std::to_string(n));
    }
    if (++seen > nnz)
      lines.fail("more entries than the " + std::to_string(nnz) + " the size line declares");
    std::int64_t i = 0, j = 0;
    if (!parse_int(tok[0], i))
      lines.fail("non-numeric row index '" + std::string(tok[0].substr(0, 40)) + "'");
    if (!parse_int(tok[1], j))
      lines.fail("non-numeric column index '" + std::string(tok[1].substr(0, 40)) + "'");
    if (i < 1 || i > rows)
      lines.fail("row index " + std::to_string(i) + " outside 1.." + std::to_string(rows));
    if (j < 1 || j > cols)
      lines.fail("column index " + std::to_string(j) + " outside 1.." + std::to_string(cols));
    float w = 1.0f;
    if (weighted) {
      double v = 0;
      if (!parse_float(tok[2], v))
        lines.fail("non-numeric or non-finite value '" + std::string(tok[2].substr(0, 40)) + "'");
      if (std::abs(v) > std::numeric_limits<float>::max()) lines.fail("value overflows float32");
      w = static_cast<float>(v);
    }
    const auto add = [&](std::int64_t s, std::int64_t d) {
      out.edges.src.push_back(s);
      out.edges.dst.push_back(d);
      if (weighted) out.edges.values.push_back(w);
    };
    add(i - 1, j - 1);
    if (symmetric && i != j) add(j - 1, i - 1);
  }
  if (seen != nnz) {
    fail(name, size_line,
         "the size line declares " + std::to_string(nnz) + " entries but the file has " +
             std::to_string(seen) + " (truncated?)");
  }
  out.edges.rows = rows;
  out.edges.cols = cols;
  return out;
}

std::vector<std::int64_t> read_graph_ptr(byte_source& src, const std::string& name,
                                         std::int64_t num_nodes) {
  line_reader lines(src, name);
  std::vector<std::int64_t> ptr;
  std::string_view line;
  while (lines.next(line)) {
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#' || t.front() == '%') continue;
    std::int64_t v = 0;
    if (!parse_int(t, v)) lines.fail("non-numeric offset '" + std::string(t.substr(0, 40)) + "'");
    if (ptr.empty() && v != 0) lines.fail("the first offset must be 0, found " + std::to_string(v));
    if (!ptr.empty() && v < ptr.back())
      lines.fail("offsets decrease (" + std::to_string(v) + " after " + std::to_string(ptr.back()) +
                 ")");
    if (num_nodes >= 0 && v > num_nodes)
      lines.fail("offset " + std::to_string(v) + " beyond the graph's " +
                 std::to_string(num_nodes) + " nodes");
    ptr.push_back(v);
  }
  if (ptr.empty()) fail(name, 0, "empty graph pointer file");
  if (num_nodes >= 0 && ptr.back() != num_nodes) {
    fail(name, lines.line_number(),
         "last offset " + std::to_string(ptr.back()) + " differs from the graph's " +
             std::to_string(num_nodes) + " nodes");
  }
  return ptr;
}

}  // namespace trisparse::io
