// Every malformed input of the foundation issue's item 4: invalid_input, one line, naming the file
// and the line (text) or the array (npy/npz).
#include "files.hpp"

namespace trisparse {
namespace {

using test::expect_invalid;
using test::temp_dir;

TEST(BadInput, EdgeListNonNumericToken) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "0 1\n2 x7\n"),
                 {"a.el:2:", "non-numeric token 'x7'"});
}

TEST(BadInput, EdgeListNegativeId) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "0 1\n-3 1\n"), {"a.el:2:", "negative node id -3"});
}

TEST(BadInput, EdgeListIdOutOfRangeOfTheHeader) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "# nodes: 3 edges: 2\n0 1\n1 3\n"),
                 {"a.el:3:", "node id 3 out of range"});
}

TEST(BadInput, EdgeListIdBeyond32Bits) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "0 99999999999\n"), {"a.el:1:", "32-bit"});
  expect_invalid(test::write_text(d / "b.el", "0 99999999999999999999999\n"),
                 {"b.el:1:", "non-numeric"});
}

TEST(BadInput, EdgeListHeaderCountDisagreesWithBody) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "# nodes: 4 edges: 3\n0 1\n1 2\n"),
                 {"a.el:1:", "header declares 3 edges but the file has 2"});
  expect_invalid(test::write_text(d / "b.el", "# nodes: x edges: 3\n0 1\n"),
                 {"b.el:1:", "'nodes'"});
}

TEST(BadInput, EdgeListWrongFieldCount) {
  temp_dir d;
  expect_invalid(test::write_text(d / "a.el", "0 1\n5\n"), {"a.el:2:", "found 1 field"});
  expect_invalid(test::write_text(d / "b.el", "0 1 1.0\n1 2\n"),
                 {"b.el:2:", "earlier lines have 3"});
  expect_invalid(test::write_text(d / "c.el", "0 1 nan\n"), {"c.el:1:", "weight"});
}

TEST(BadInput, EmptyFiles) {
  temp_dir d;
  expect_invalid(test::write_text(d / "e.el", ""), {"e.el", "empty file"});
  expect_invalid(test::write_text(d / "c.el", "# only a comment\n"), {"c.el:1:", "no edges"});
  expect_invalid(test::write_text(d / "e.mtx", ""), {"e.mtx", "empty file"});
  expect_invalid(test::write_text(d / "e.npz", ""), {"e.npz", "empty file"});
  expect_invalid(test::write_bytes(d / "z.npz", test::xz_bytes("")), {"z.npz", "empty file"});
  expect_invalid(test::write_text(d / "e.npy", ""), {"e.npy", "empty file"});
  expect_invalid(test::write_text(d / "h.npy", "\x93NUMPY"), {"h.npy[edge_index]", "not a .npy"});
  expect_invalid(test::write_text(d / "e.tsc", ""), {"e.tsc", "empty file"});
  expect_invalid(test::write_text(d / "t.tsc", "TRSPARSE"), {"t.tsc", "truncated cache"});
}

TEST(BadInput, TruncatedCompressedStreams) {
  temp_dir d;
  std::string text;
  for (int i = 0; i < 20000; ++i) text += std::to_string(i) + " " + std::to_string(i + 1) + "\n";
  auto gz = test::read_bytes(test::write_gzip(d / "full.gz", text));
  gz.resize(gz.size() / 2);
  expect_invalid(test::write_bytes(d / "t.el.gz", gz), {"t.el.gz", "truncated gzip"});
  auto xz = test::xz_bytes(text);
  xz.resize(xz.size() / 2);
  expect_invalid(test::write_bytes(d / "t.el.xz", xz), {"t.el.xz", "xz"});
  auto corrupt = test::xz_bytes(text);
  corrupt[corrupt.size() / 2] ^= 0xFF;
  expect_invalid(test::write_bytes(d / "c.el.xz", corrupt), {"c.el.xz", "xz"});
}

TEST(BadInput, DecompressionIsBounded) {
  temp_dir d;
  const std::string text(1 << 20, '\n');
  expect_invalid(test::write_bytes(d / "bomb.el.xz", test::xz_bytes(text)),
                 {"bomb.el.xz", "exceeds the limit"}, {.max_bytes = 1 << 16});
}

TEST(BadInput, TinyFileDeclaringHugeGraphIsRejectedBeforeAllocating) {
  temp_dir d;
  expect_invalid(test::write_text(d / "h.el", "# nodes: 2147483647 edges: 1\n0 1\n"),
                 {"h.el", "2147483647 nodes", "over the limit"});
  expect_invalid(
      test::write_text(
          d / "h.mtx",
          "%%MatrixMarket matrix coordinate pattern general\n2147483647 2147483647 1\n1 1\n"),
      {"h.mtx", "over the limit"});
}

TEST(BadInput, OverlongLine) {
  temp_dir d;
  expect_invalid(test::write_text(d / "l.el", "0 1\n" + std::string(3 << 20, '7') + "\n"),
                 {"l.el:2:", "line longer"});
}

TEST(BadInput, MatrixMarketCases) {
  temp_dir d;
  const std::string h = "%%MatrixMarket matrix coordinate pattern general\n";
  expect_invalid(test::write_text(d / "a.mtx", h + "3 3 2\n1 1\n"),
                 {"a.mtx:2:", "declares 2 entries but the file has 1"});
  expect_invalid(test::write_text(d / "b.mtx", h + "3 3 1\n1 1\n2 2\n"),
                 {"b.mtx:4:", "more entries"});
  expect_invalid(test::write_text(d / "c.mtx", h + "3 3 1\n4 1\n"),
                 {"c.mtx:3:", "row index 4 outside 1..3"});
  expect_invalid(test::write_text(d / "d.mtx", h + "3 3 1\n1 0\n"), {"d.mtx:3:", "column index 0"});
  expect_invalid(test::write_text(d / "e.mtx", h + "3 3 1\n1 q\n"),
                 {"e.mtx:3:", "non-numeric column index 'q'"});
  expect_invalid(test::write_text(d / "f.mtx", h + "3 3\n"), {"f.mtx:2:", "size line"});
  expect_invalid(test::write_text(d / "g.mtx", "%%MatrixMarket matrix array real general\n2 2\n"),
                 {"g.mtx:1:", "coordinate"});
  expect_invalid(
      test::write_text(d / "h.mtx", "%%MatrixMarket matrix coordinate complex general\n"),
      {"h.mtx:1:", "complex"});
  expect_invalid(
      test::write_text(d / "i.mtx", "%%MatrixMarket matrix coordinate real general\n2 2 1\n1 1\n"),
      {"i.mtx:3:", "expected 3 fields"});
  expect_invalid(test::write_text(d / "j.mtx", h + "-2 3 1\n"), {"j.mtx:2:", "negative size"});
  expect_invalid(test::write_text(d / "k.mtx", h + "2 2 9\n"),
                 {"k.mtx:2:", "more entries declared"});
}

TEST(BadInput, NpzWrongDtypeOrShapeOrMissingArray) {
  temp_dir d;
  const auto i64 = [](std::vector<std::int64_t> v) {
    return test::npy_bytes<std::int64_t>("<i8", {static_cast<std::int64_t>(v.size())}, v);
  };
  expect_invalid(
      test::write_npz(d / "f.npz", {{"src_li.npy", test::npy_bytes<float>("<f4", {2}, {0, 1})},
                                    {"dst_li.npy", i64({1, 0})}}),
      {"f.npz[src_li]", "expected an integer array, found float32"});
  expect_invalid(
      test::write_npz(d / "s.npz",
                      {{"src_li.npy", test::npy_bytes<std::int64_t>("<i8", {2, 1}, {0, 1})},
                       {"dst_li.npy", i64({1, 0})}}),
      {"s.npz[src_li]", "1-D"});
  expect_invalid(
      test::write_npz(d / "l.npz", {{"src_li.npy", i64({0, 1, 2})}, {"dst_li.npy", i64({1, 0})}}),
      {"l.npz[dst_li]", "differs"});
  expect_invalid(test::write_npz(d / "m.npz", {{"src_li.npy", i64({0})}}),
                 {"m.npz", "missing arrays"});
  expect_invalid(
      test::write_npz(d / "n.npz", {{"src_li.npy", i64({0, -1})}, {"dst_li.npy", i64({1, 0})}}),
      {"n.npz[src_li]", "negative node id -1"});
  expect_invalid(test::write_npz(d / "o.npz", {{"src_li.npy", i64({0, 5})},
                                               {"dst_li.npy", i64({1, 0})},
                                               {"num_nodes.npy", i64({3})}}),
                 {"o.npz[src_li]", "node id 5", "out of range for 3 nodes"});
  expect_invalid(test::write_npz(d / "p.npz", {{"src_li.npy", i64({0})},
                                               {"dst_li.npy", i64({1})},
                                               {"num_nodes.npy", i64({3, 4})}}),
                 {"p.npz[num_nodes]", "single integer"});
  auto bad = i64({0, 1});
  bad.resize(bad.size() - 3);  // truncated array data inside the archive
  expect_invalid(test::write_npz(d / "t.npz", {{"src_li.npy", bad}, {"dst_li.npy", i64({1, 0})}}),
                 {"t.npz[src_li]", "truncated"});
  auto big_endian = i64({0, 1});
  const std::string key = "'<i8'";
  std::copy(std::string("'>i8'").begin(), std::string("'>i8'").end(),
            std::search(big_endian.begin(), big_endian.end(), key.begin(), key.end()));
  expect_invalid(
      test::write_npz(d / "b.npz", {{"src_li.npy", big_endian}, {"dst_li.npy", i64({1, 0})}}),
      {"b.npz[src_li]", "unsupported dtype"});
}

TEST(BadInput, NpzCorruptArchive) {
  temp_dir d;
  std::vector<std::int64_t> ids(1000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i % 7);
  auto bytes = test::read_bytes(test::write_npz(
      d / "ok.npz", {{"src_li.npy", test::npy_bytes<std::int64_t>("<i8", {1000}, ids)},
                     {"dst_li.npy", test::npy_bytes<std::int64_t>("<i8", {1000}, ids)}}));
  auto corrupt = bytes;
  corrupt[50] ^= 0x5A;  // inside the first member's deflated data (its header is 40 bytes)
  expect_invalid(test::write_bytes(d / "c.npz", corrupt), {"c.npz"});
  bytes.resize(bytes.size() / 2);
  expect_invalid(test::write_bytes(d / "t.npz", bytes), {"t.npz"});
}

TEST(BadInput, NpyWrongShape) {
  temp_dir d;
  expect_invalid(test::write_bytes(
                     d / "s.npy", test::npy_bytes<std::int64_t>("<i8", {3, 2}, {0, 1, 2, 3, 4, 5})),
                 {"s.npy[edge_index]", "expected shape [2, E], found [3, 2]"});
  expect_invalid(test::write_bytes(d / "f.npy", test::npy_bytes<double>("<f8", {2, 1}, {0, 1})),
                 {"f.npy[edge_index]", "float64"});
}

TEST(BadInput, CorruptOrTruncatedCache) {
  temp_dir d;
  write_cache(test::random_pattern(100, 100, 5, 1), d / "g.tsc");
  auto bytes = test::read_bytes(d / "g.tsc");
  auto flipped = bytes;
  flipped[60] ^= 0x01;
  expect_invalid(test::write_bytes(d / "c.tsc", flipped), {"c.tsc", "checksum mismatch"});
  auto truncated = bytes;
  truncated.resize(bytes.size() - 9);
  expect_invalid(test::write_bytes(d / "t.tsc", truncated), {"t.tsc", "truncated or corrupt"});
  auto version = bytes;
  version[12] = 9;
  expect_invalid(test::write_bytes(d / "v.tsc", version), {"v.tsc", "cache version 9"});
  auto huge = bytes;
  huge[47] = 0x7F;  // nnz = 2^62 and more: rejected before any allocation
  expect_invalid(test::write_bytes(d / "h.tsc", huge), {"h.tsc", "implausible sizes"});
}

}  // namespace
}  // namespace trisparse
