// NumPy .npy arrays and .npz archives (through libzip).
#include <zip.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "readers.hpp"

namespace trisparse::io {

namespace {

struct npy_array {
  char kind = 0;         // 'i', 'u', 'f'
  std::size_t item = 0;  // bytes per element
  bool fortran = false;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  std::int64_t count() const {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    return n;
  }
};

// Finds 'key' in the header dict and returns what follows the colon.
std::string_view dict_value(std::string_view header, std::string_view key,
                            const std::string& where) {
  const std::string quoted = "'" + std::string(key) + "'";
  const std::size_t at = header.find(quoted);
  if (at == std::string_view::npos) fail(where, 0, "npy header lacks '" + std::string(key) + "'");
  std::size_t i = at + quoted.size();
  while (i < header.size() && header[i] == ' ') ++i;
  if (i >= header.size() || header[i] != ':')
    fail(where, 0, "malformed npy header near '" + std::string(key) + "'");
  ++i;
  while (i < header.size() && header[i] == ' ') ++i;
  return header.substr(i);
}

npy_array parse_npy(std::span<const std::byte> bytes, const std::string& where) {
  static constexpr unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, 6) != 0) {
    fail(where, 0, "not a .npy array (bad magic; truncated or wrong file type)");
  }
  const auto u8 = [&](std::size_t i) { return std::to_integer<std::size_t>(bytes[i]); };
  const std::size_t major = u8(6);
  std::size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = u8(8) | (u8(9) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail(where, 0, "truncated npy header");
    header_len = u8(8) | (u8(9) << 8) | (u8(10) << 16) | (u8(11) << 24);
    header_start = 12;
  } else {
    fail(where, 0, "unsupported npy version " + std::to_string(major));
  }
  if (header_len > bytes.size() - header_start || header_len > (1u << 20))
    fail(where, 0, "truncated npy header");
  const std::string_view header(reinterpret_cast<const char*>(bytes.data()) + header_start,
                                header_len);
  npy_array a;
  // descr
  std::string_view d = dict_value(header, "descr", where);
  if (d.size() < 2 || (d[0] != '\'' && d[0] != '"')) fail(where, 0, "npy descr is not a string");
  const std::size_t close = d.find(d[0], 1);
  if (close == std::string_view::npos) fail(where, 0, "unterminated npy descr");
  const std::string_view descr = d.substr(1, close - 1);
  if (descr.size() < 3 || (descr[0] != '<' && descr[0] != '|' && descr[0] != '=')) {
    fail(where, 0,
         "unsupported dtype '" + std::string(descr) + "' (little-endian integers or floats only)");
  }
  a.kind = descr[1];
  std::int64_t item = 0;
  if (!parse_int(descr.substr(2), item) || (item != 1 && item != 2 && item != 4 && item != 8) ||
      (a.kind != 'i' && a.kind != 'u' && a.kind != 'f')) {
    fail(where, 0, "unsupported dtype '" + std::string(descr) + "'");
  }
  a.item = static_cast<std::size_t>(item);
  // fortran_order
  const std::string_view f = dict_value(header, "fortran_order", where);
  if (f.starts_with("True"))
    a.fortran = true;
  else if (!f.starts_with("False"))
    fail(where, 0, "npy fortran_order is neither True nor False");
  // shape
  std::string_view s = dict_value(header, "shape", where);
  if (s.empty() || s[0] != '(') fail(where, 0, "npy shape is not a tuple");
  const std::size_t end = s.find(')');
  if (end == std::string_view::npos) fail(where, 0, "unterminated npy shape");
  std::string_view body = s.substr(1, end - 1);
  std::int64_t total = 1;
  while (!body.empty()) {
    while (!body.empty() && (body.front() == ' ' || body.front() == ',')) body.remove_prefix(1);
    if (body.empty()) break;
    std::size_t k = 0;
    while (k < body.size() && body[k] != ',' && body[k] != ' ') ++k;
    std::int64_t dim = 0;
    if (!parse_int(body.substr(0, k), dim) || dim < 0)
      fail(where, 0, "bad npy shape entry '" + std::string(body.substr(0, k)) + "'");
    if (a.shape.size() >= 8) fail(where, 0, "npy array has too many dimensions");
    a.shape.push_back(dim);
    if (__builtin_mul_overflow(total, dim, &total) || total > (std::int64_t{1} << 48)) {
      fail(where, 0, "npy shape is implausibly large");
    }
    body.remove_prefix(k);
  }
  const std::size_t data_start = header_start + header_len;
  const std::uint64_t need = static_cast<std::uint64_t>(total) * a.item;  // < 2^51: no overflow
  const std::uint64_t have = bytes.size() - data_start;
  if (need != have) {
    fail(where, 0,
         "array data is " + std::to_string(have) + " bytes but shape and dtype need " +
             std::to_string(need) + (need > have ? " (truncated)" : " (trailing bytes)"));
  }
  a.data = bytes.subspan(data_start);
  return a;
}

std::int64_t int_at(const npy_array& a, std::int64_t i, const std::string& where) {
  const std::byte* p = a.data.data() + static_cast<std::size_t>(i) * a.item;
  std::int64_t v = 0;
  if (a.kind == 'i') {
    switch (a.item) {
      case 1: {
        std::int8_t x;
        std::memcpy(&x, p, 1);
        v = x;  // NOLINT(bugprone-signed-char-misuse): int8 arrays are signed data
        break;
      }
      case 2: {
        std::int16_t x;
        std::memcpy(&x, p, 2);
        v = x;
        break;
      }
      case 4: {
        std::int32_t x;
        std::memcpy(&x, p, 4);
        v = x;
        break;
      }
      default: {
        std::memcpy(&v, p, 8);
        break;
      }
    }
  } else if (a.kind == 'u') {
    std::uint64_t x = 0;
    std::memcpy(&x, p, a.item);
    if (x > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(where, 0, "element " + std::to_string(i) + " overflows int64");
    }
    v = static_cast<std::int64_t>(x);
  } else {
    fail(where, 0, "expected an integer array, found floating point");
  }
  return v;
}

void require_int(const npy_array& a, const std::string& where) {
  if (a.kind == 'f')
    fail(where, 0, "expected an integer array, found float" + std::to_string(8 * a.item));
}

// Fills edges from two id sequences; nodes = declared or max + 1.
void fill_edges(loaded_graph& out, const npy_array& a, std::int64_t count,
                const std::function<std::int64_t(std::int64_t)>& src_index,
                const std::function<std::int64_t(std::int64_t)>& dst_index,
                std::int64_t declared_nodes, const std::string& where) {
  constexpr std::int64_t kMaxId = std::numeric_limits<std::int32_t>::max() - 1;
  out.edges.src.resize(count);
  out.edges.dst.resize(count);
  std::int64_t max_id = -1;
  for (std::int64_t e = 0; e < count; ++e) {
    const std::int64_t s = int_at(a, src_index(e), where), d = int_at(a, dst_index(e), where);
    for (const std::int64_t id : {s, d}) {
      if (id < 0)
        fail(where, 0, "negative node id " + std::to_string(id) + " at edge " + std::to_string(e));
      if (declared_nodes >= 0 && id >= declared_nodes) {
        fail(where, 0,
             "node id " + std::to_string(id) + " at edge " + std::to_string(e) +
                 " out of range for " + std::to_string(declared_nodes) + " nodes");
      }
      if (id > kMaxId)
        fail(where, 0, "node id " + std::to_string(id) + " exceeds the 32-bit index range");
    }
    out.edges.src[e] = s;
    out.edges.dst[e] = d;
    max_id = std::max({max_id, s, d});
  }
  out.edges.rows = out.edges.cols = declared_nodes >= 0 ? declared_nodes : max_id + 1;
}

struct zip_closer {
  void operator()(zip_t* z) const { zip_discard(z); }
};

std::vector<std::byte> zip_entry(zip_t* z, const std::string& entry, const std::string& name,
                                 std::uint64_t max_bytes) {
  const std::string where = name + "[" + entry.substr(0, entry.size() - 4) + "]";
  zip_stat_t st;
  zip_stat_init(&st);
  if (zip_stat(z, entry.c_str(), 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE)) {
    fail(where, 0, "cannot read archive entry");
  }
  if (st.size > max_bytes)
    fail(where, 0, "entry of " + std::to_string(st.size) + " bytes exceeds the limit");
  std::vector<std::byte> data(st.size);
  zip_file_t* f = zip_fopen(z, entry.c_str(), 0);
  if (f == nullptr) fail(where, 0, std::string("cannot open archive entry: ") + zip_strerror(z));
  const zip_int64_t got = data.empty() ? 0 : zip_fread(f, data.data(), data.size());
  // Reading one more byte makes libzip verify the CRC at the end of the entry.
  std::byte extra{};
  const zip_int64_t tail = zip_fread(f, &extra, 1);
  const std::string ferr = zip_file_strerror(f);
  zip_fclose(f);
  if (got < 0 || tail < 0) fail(where, 0, "corrupt archive entry (" + ferr + ")");
  if (static_cast<zip_uint64_t>(got) != st.size || tail != 0)
    fail(where, 0, "archive entry size does not match its header (truncated?)");
  return data;
}

}  // namespace

loaded_graph read_npy_edge_index(std::span<const std::byte> bytes, const std::string& name) {
  const std::string where = name + "[edge_index]";
  const npy_array a = parse_npy(bytes, where);
  require_int(a, where);
  if (a.shape.size() != 2 || a.shape[0] != 2) {
    std::string shape;
    for (const auto d : a.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    fail(where, 0, "expected shape [2, E], found [" + shape + "]");
  }
  const std::int64_t e = a.shape[1];
  loaded_graph out;
  out.info.format = file_format::npy;
  if (a.fortran) {
    fill_edges(
        out, a, e, [](std::int64_t i) { return 2 * i; }, [](std::int64_t i) { return 2 * i + 1; },
        -1, where);
  } else {
    fill_edges(
        out, a, e, [](std::int64_t i) { return i; }, [e](std::int64_t i) { return e + i; }, -1,
        where);
  }
  return out;
}

loaded_graph read_npz(std::span<const std::byte> bytes, const std::string& name,
                      std::uint64_t max_bytes) {
  zip_error_t zerr;
  zip_error_init(&zerr);
  zip_source_t* src = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &zerr);
  if (src == nullptr) fail(name, 0, "cannot read archive");
  std::unique_ptr<zip_t, zip_closer> z(zip_open_from_source(src, ZIP_RDONLY, &zerr));
  if (!z) {
    zip_source_free(src);
    const std::string why = zip_error_strerror(&zerr);
    zip_error_fini(&zerr);
    fail(name, 0, "not a valid npz/zip archive (" + why + ")");
  }
  zip_error_fini(&zerr);
  const auto has = [&](const char* entry) { return zip_name_locate(z.get(), entry, 0) >= 0; };
  loaded_graph out;
  out.info.format = file_format::npz;
  if (has("src_li.npy") && has("dst_li.npy")) {
    std::int64_t nodes = -1;
    if (has("num_nodes.npy")) {
      const auto raw = zip_entry(z.get(), "num_nodes.npy", name, max_bytes);
      const std::string where = name + "[num_nodes]";
      const npy_array a = parse_npy(raw, where);
      require_int(a, where);
      if (a.count() != 1)
        fail(where, 0,
             "expected a single integer, found " + std::to_string(a.count()) + " elements");
      nodes = int_at(a, 0, where);
      if (nodes < 0) fail(where, 0, "negative node count " + std::to_string(nodes));
      if (nodes > std::numeric_limits<std::int32_t>::max())
        fail(where, 0, "node count exceeds the 32-bit index range");
      out.info.declared_nodes = nodes;
    }
    const auto s_raw = zip_entry(z.get(), "src_li.npy", name, max_bytes);
    const auto d_raw = zip_entry(z.get(), "dst_li.npy", name, max_bytes);
    const npy_array s = parse_npy(s_raw, name + "[src_li]");
    const npy_array d = parse_npy(d_raw, name + "[dst_li]");
    require_int(s, name + "[src_li]");
    require_int(d, name + "[dst_li]");
    if (s.shape.size() != 1) fail(name + "[src_li]", 0, "expected a 1-D array");
    if (d.shape.size() != 1) fail(name + "[dst_li]", 0, "expected a 1-D array");
    if (s.shape[0] != d.shape[0]) {
      fail(name + "[dst_li]", 0,
           "length " + std::to_string(d.shape[0]) + " differs from src_li's " +
               std::to_string(s.shape[0]));
    }
    // Check each array's ids with its own name, then pair them.
    loaded_graph tmp;
    fill_edges(
        tmp, d, d.shape[0], [](std::int64_t i) { return i; }, [](std::int64_t i) { return i; },
        nodes, name + "[dst_li]");
    fill_edges(
        out, s, s.shape[0], [](std::int64_t i) { return i; }, [](std::int64_t i) { return i; },
        nodes, name + "[src_li]");
    out.edges.dst = std::move(tmp.edges.src);
    const std::int64_t n = std::max(out.edges.rows, tmp.edges.rows);
    out.edges.rows = out.edges.cols = nodes >= 0 ? nodes : n;
    out.info.declared_edges = s.shape[0];
    return out;
  }
  if (has("edge_index.npy")) {
    const auto raw = zip_entry(z.get(), "edge_index.npy", name, max_bytes);
    loaded_graph g = read_npy_edge_index(raw, name);
    g.info.format = file_format::npz;
    return g;
  }
  fail(name, 0, "missing arrays: expected src_li, dst_li (and num_nodes) or edge_index");
}

}  // namespace trisparse::io

namespace trisparse {

void write_npy(const std::filesystem::path& path, std::string_view descr,
               std::span<const std::int64_t> shape, const void* data, std::size_t bytes) {
  std::string shape_text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    shape_text += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
    if (i + 1 < shape.size()) shape_text += " ";
  }
  shape_text += ")";
  std::string header = "{'descr': '" + std::string(descr) +
                       "', 'fortran_order': False, 'shape': " + shape_text + ", }";
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  if (!f) throw error(path.string() + ": cannot open for writing");
  const unsigned char magic[] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  f.write(reinterpret_cast<const char*>(magic), sizeof magic);
  const auto len = static_cast<std::uint16_t>(header.size());
  const unsigned char len_bytes[] = {static_cast<unsigned char>(len & 0xFF),
                                     static_cast<unsigned char>(len >> 8)};
  f.write(reinterpret_cast<const char*>(len_bytes), 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) throw error(path.string() + ": write failed");
}

}  // namespace trisparse
