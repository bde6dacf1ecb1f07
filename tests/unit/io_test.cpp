#include "files.hpp"

namespace trisparse {
namespace {

using test::temp_dir;

const char* kEdges =
    "# tiny: a test graph\n"
    "# nodes: 5 edges: 4 directed: no\n"
    "0 1\n1,2\n\n3\t4\n% another comment\n4 0\r\n";

TEST(Io, EdgeListWithHeaderSymmetrizesWhenUndirected) {
  temp_dir d;
  const auto p = test::write_text(d / "g.el", kEdges);
  const loaded_graph raw = read_edges(p);
  EXPECT_EQ(raw.info.declared_nodes, 5);
  EXPECT_EQ(raw.info.directed, false);
  EXPECT_EQ(raw.info.description, "tiny: a test graph");
  EXPECT_EQ(raw.edges.nnz(), 4);
  const csr_graph g = read_graph(p);
  EXPECT_EQ(g.nnz(), 8);
  EXPECT_TRUE(compute_degree_stats(g).symmetric);
  EXPECT_EQ(read_graph(p, {.sym = symmetry::as_stored}).nnz(), 4);
}

TEST(Io, GzipAndXzGiveTheSameGraph) {
  temp_dir d;
  const csr_graph plain = read_graph(test::write_text(d / "g.el", kEdges));
  EXPECT_EQ(read_graph(test::write_gzip(d / "g.el.gz", kEdges)), plain);
  EXPECT_EQ(read_graph(test::write_bytes(d / "g.el.xz", test::xz_bytes(kEdges))), plain);
  // Concatenated gzip members are one stream.
  const auto a = test::read_bytes(test::write_gzip(d / "a.gz", "0 1\n"));
  auto b = test::read_bytes(test::write_gzip(d / "b.gz", "1 2\n"));
  b.insert(b.begin(), a.begin(), a.end());
  EXPECT_EQ(read_graph(test::write_bytes(d / "ab.el.gz", b)).nnz(), 2);
}

TEST(Io, WeightedEdgeListKeepsValues) {
  temp_dir d;
  const csr_graph g = read_graph(test::write_text(d / "w.txt", "0 1 0.5\n1 0 2.5\n"));
  EXPECT_EQ(g.values, (std::vector<float>{0.5f, 2.5f}));
}

TEST(Io, MatrixMarketGeneralSymmetricAndRectangular) {
  temp_dir d;
  const auto sym = test::write_text(
      d / "s.mtx",
      "%%MatrixMarket matrix coordinate pattern symmetric\n% c\n3 3 3\n1 1\n2 1\n3 2\n");
  const csr_graph s = read_graph(sym);
  EXPECT_EQ(s.nnz(), 5);  // (1,1) once; (2,1), (3,2) mirrored
  EXPECT_TRUE(compute_degree_stats(s).symmetric);
  const auto rect = test::write_text(
      d / "r.mtx", "%%MatrixMarket matrix coordinate real general\n2 5 2\n1 5 1.5\n2 1 -2\n");
  const csr_graph r = read_graph(rect);
  EXPECT_EQ(r.rows, 2);
  EXPECT_EQ(r.cols, 5);
  EXPECT_EQ(r.values, (std::vector<float>{1.5f, -2.0f}));
  const auto integer = test::write_text(d / "i.mtx.gz", "");
  test::write_gzip(d / "i.mtx.gz",
                   "%%MatrixMarket matrix coordinate integer general\n2 2 1\n2 2 7\n");
  EXPECT_EQ(read_graph(integer).values, (std::vector<float>{7.0f}));
}

TEST(Io, WritersRoundTripExactly) {
  temp_dir d;
  for (const bool weighted : {false, true}) {
    const csr_graph g = test::random_pattern(300, 300, 9, 11, weighted);
    write_matrix_market(g, d / "g.mtx");
    EXPECT_EQ(read_graph(d / "g.mtx"), g);
    write_cache(g, d / "g.tsc");
    EXPECT_EQ(read_graph(d / "g.tsc"), g);
    EXPECT_EQ(read_cache(d / "g.tsc"), g);
    write_edge_list(g, d / "g.el");
    EXPECT_EQ(read_graph(d / "g.el", {.sym = symmetry::as_stored}), g);
  }
  const csr_graph rect = test::random_pattern(30, 70, 9, 12);
  write_cache(rect, d / "r.tsc");
  EXPECT_EQ(read_graph(d / "r.tsc"), rect);
  write_matrix_market(rect, d / "r.mtx");
  EXPECT_EQ(read_graph(d / "r.mtx"), rect);
}

TEST(Io, NpzInTheFused3sExportFormat) {
  temp_dir d;
  const std::vector<std::int64_t> src{0, 1, 2, 2}, dst{1, 2, 0, 3};
  for (const bool deflate : {true, false}) {
    const auto p =
        test::write_npz(d / "g.npz",
                        {{"src_li.npy", test::npy_bytes<std::int64_t>("<i8", {4}, src)},
                         {"dst_li.npy", test::npy_bytes<std::int64_t>("<i8", {4}, dst)},
                         {"num_nodes.npy", test::npy_bytes<std::int64_t>("<i8", {}, {6})}},
                        deflate);
    const csr_graph g = read_graph(p);
    EXPECT_EQ(g.rows, 6);
    EXPECT_EQ(g.nnz(), 4);
    EXPECT_EQ(g.col_idx, (std::vector<std::int32_t>{1, 2, 0, 3}));
  }
  // int32 arrays, no num_nodes: nodes = max id + 1.
  const auto p32 = test::write_npz(
      d / "g32.npz", {{"src_li.npy", test::npy_bytes<std::int32_t>("<i4", {2}, {0, 4})},
                      {"dst_li.npy", test::npy_bytes<std::int32_t>("<i4", {2}, {4, 0})}});
  EXPECT_EQ(read_graph(p32).rows, 5);
}

TEST(Io, NpyEdgeIndexCAndFortranOrder) {
  temp_dir d;
  // [2, 3] C order: src row then dst row.
  const auto c = test::write_bytes(
      d / "ei.npy", test::npy_bytes<std::int64_t>("<i8", {2, 3}, {0, 1, 2, 1, 2, 0}));
  const csr_graph g = read_graph(c);
  EXPECT_EQ(g.rows, 3);
  EXPECT_EQ(g.col_idx, (std::vector<std::int32_t>{1, 2, 0}));
  // The same array in Fortran order: pairs interleaved.
  auto f = test::npy_bytes<std::int64_t>("<i8", {2, 3}, {0, 1, 1, 2, 2, 0});
  const std::string key = "'fortran_order': False";
  auto it = std::search(f.begin(), f.end(), key.begin(), key.end());
  ASSERT_NE(it, f.end());
  const std::string repl = "'fortran_order': True ";  // same length, so the header size holds
  std::copy(repl.begin(), repl.end(), it);
  EXPECT_EQ(read_graph(test::write_bytes(d / "ef.npy", f)).col_idx, g.col_idx);
}

TEST(Io, GraphPtrFiles) {
  temp_dir d;
  EXPECT_EQ(read_graph_ptr(test::write_text(d / "p", "0\n3\n7\n"), 7),
            (std::vector<std::int64_t>{0, 3, 7}));
  EXPECT_THROW(read_graph_ptr(test::write_text(d / "q", "0\n3\n2\n"), -1), invalid_input);
  EXPECT_THROW(read_graph_ptr(test::write_text(d / "r", "0\n3\n"), 7), invalid_input);
}

TEST(Io, MissingFileIsAnErrorNamingIt) {
  try {
    (void)read_graph("/nonexistent/g.el");
    FAIL();
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/g.el"), std::string::npos);
  }
}

}  // namespace
}  // namespace trisparse
