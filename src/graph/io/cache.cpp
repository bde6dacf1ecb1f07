// The binary cache: "TRSPARSE", u32 kind (1 = CSR), u32 version, u32 flags (bit 0: values),
// u32 reserved, i64 rows, i64 cols, i64 nnz, row_ptr[rows + 1] i64, col_idx[nnz] i32,
// values[nnz] f32 (if flagged), u32 CRC-32 of every byte before it. Little-endian.
#include <zlib.h>

#include <cstring>
#include <fstream>
#include <limits>

#include "readers.hpp"

namespace trisparse::io {

namespace {
constexpr char kMagic[8] = {'T', 'R', 'S', 'P', 'A', 'R', 'S', 'E'};
constexpr std::uint32_t kKindCsr = 1, kVersion = 1, kFlagValues = 1;
constexpr std::size_t kHeader = 48;

std::uint32_t crc_of(const std::byte* data, std::size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (n > 0) {
    const uInt k = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data), k);
    data += k;
    n -= k;
  }
  return static_cast<std::uint32_t>(crc);
}

template <class T>
T get(std::span<const std::byte> b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}
}  // namespace

csr_graph read_cache_bytes(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.size() < kHeader + 4)
    fail(name, 0, "truncated cache file (" + std::to_string(bytes.size()) + " bytes)");
  if (std::memcmp(bytes.data(), kMagic, 8) != 0)
    fail(name, 0, "not a trisparse cache file (bad magic)");
  const auto kind = get<std::uint32_t>(bytes, 8), version = get<std::uint32_t>(bytes, 12);
  const auto flags = get<std::uint32_t>(bytes, 16);
  if (kind != kKindCsr) fail(name, 0, "unknown cache content kind " + std::to_string(kind));
  if (version != kVersion) {
    fail(name, 0,
         "cache version " + std::to_string(version) + " is not readable by this build (reads " +
             std::to_string(kVersion) + "); re-run 'trisparse convert'");
  }
  if ((flags & ~kFlagValues) != 0) fail(name, 0, "unknown cache flags");
  const auto rows = get<std::int64_t>(bytes, 24), cols = get<std::int64_t>(bytes, 32),
             nnz = get<std::int64_t>(bytes, 40);
  if (rows < 0 || cols < 0 || nnz < 0 || cols > std::numeric_limits<std::int32_t>::max() ||
      rows > (std::int64_t{1} << 40) || nnz > (std::int64_t{1} << 40)) {
    fail(name, 0,
         "implausible sizes in cache header (rows " + std::to_string(rows) + ", cols " +
             std::to_string(cols) + ", nnz " + std::to_string(nnz) + ")");
  }
  const bool values = flags & kFlagValues;
  // rows, nnz < 2^40 (checked above): no overflow in 64 bits.
  const std::uint64_t expect = kHeader + 8 * static_cast<std::uint64_t>(rows + 1) +
                               4 * static_cast<std::uint64_t>(nnz) * (values ? 2 : 1) + 4;
  if (expect != bytes.size()) {
    fail(name, 0,
         "cache file is " + std::to_string(bytes.size()) + " bytes but its header implies " +
             std::to_string(expect) + " (truncated or corrupt)");
  }
  const std::size_t body = bytes.size() - 4;
  if (crc_of(bytes.data(), body) != get<std::uint32_t>(bytes, body)) {
    fail(name, 0, "checksum mismatch: the cache file is corrupt");
  }
  csr_graph g;
  g.rows = rows;
  g.cols = cols;
  g.row_ptr.resize(rows + 1);
  g.col_idx.resize(nnz);
  std::size_t at = kHeader;
  std::memcpy(g.row_ptr.data(), bytes.data() + at, 8 * (rows + 1));
  at += 8 * (rows + 1);
  std::memcpy(g.col_idx.data(), bytes.data() + at, 4 * nnz);
  at += 4 * nnz;
  if (values) {
    g.values.resize(nnz);
    std::memcpy(g.values.data(), bytes.data() + at, 4 * nnz);
  }
  try {
    g.check();
  } catch (const invalid_input& e) {
    fail(name, 0, std::string("inconsistent cache content: ") + e.what());
  }
  return g;
}

}  // namespace trisparse::io

namespace trisparse {

void write_cache(const csr_graph& g, const std::filesystem::path& path) {
  g.check();
  std::vector<std::byte> out(io::kHeader);
  const auto put = [&](std::size_t at, const auto& v) {
    std::memcpy(out.data() + at, &v, sizeof v);
  };
  std::memcpy(out.data(), io::kMagic, 8);
  put(8, io::kKindCsr);
  put(12, io::kVersion);
  put(16, g.has_values() ? io::kFlagValues : std::uint32_t{0});
  put(20, std::uint32_t{0});
  put(24, g.rows);
  put(32, g.cols);
  put(40, g.nnz());
  const auto append = [&](const void* p, std::size_t n) {
    const std::size_t at = out.size();
    out.resize(at + n);
    if (n > 0) std::memcpy(out.data() + at, p, n);
  };
  append(g.row_ptr.data(), 8 * g.row_ptr.size());
  append(g.col_idx.data(), 4 * g.col_idx.size());
  if (g.has_values()) append(g.values.data(), 4 * g.values.size());
  const std::uint32_t crc = io::crc_of(out.data(), out.size());
  append(&crc, 4);
  std::ofstream f(path, std::ios::binary);
  if (!f) throw error(path.string() + ": cannot open for writing");
  f.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (!f) throw error(path.string() + ": write failed");
}

}  // namespace trisparse
