// GCN and AGNN layers on CUDA (cuBLAS + ME-BCRS kernels) against the float64 CPU layers (label
// gpu; skipped without a device).
#include "device_tensor.hpp"

namespace trisparse {
namespace {

double tolerance(dtype in, dtype out) { return test::gpu_tolerance(in, out, 8); }

// The layer run twice on the GPU (poisoned output): bitwise equal, finite, near the CPU layer.
template <class Run>
void check_runs(const host_tensor& want, dtype in, dtype out_type, Run&& run) {
  test::device_tensor out(host_tensor(out_type, want.rows(), 1, want.dim()));
  host_tensor first;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out, [&] { run(out.view()); }, first));
  for (std::int64_t i = 0; i < first.numel(); ++i)
    ASSERT_TRUE(std::isfinite(first.get(i))) << "unwritten or non-finite output at " << i;
  const auto e = test::compare(first, want);
  EXPECT_LE(e.relative(), tolerance(in, out_type)) << "max abs " << e.max_abs;
}

void check_gcn(const csr_graph& g, dtype in, dtype out, std::int64_t fi, std::int64_t fo,
               std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(in)) + "->" + std::string(to_string(out)) + " " +
               std::to_string(fi) + "->" + std::to_string(fo) + " nnz " + std::to_string(g.nnz()));
  host_tensor x(in, g.rows, 1, fi), w(in, fi, 1, fo), want(dtype::f64, g.rows, 1, fo);
  x.fill_uniform(-1, 1, seed);
  w.fill_uniform(-0.5, 0.5, seed + 1);
  gcn_layer::build(g).forward(x.view(), w.view(), want.view());
  const gcn_layer layer = gcn_layer::build(g, device_kind::cuda);
  test::device_tensor dx(x), dw(w);
  check_runs(want, in, out, [&](const tensor_view& o) { layer.forward(dx.view(), dw.view(), o); });
}

void check_agnn(const csr_graph& g, dtype in, dtype out, std::int64_t f, double beta,
                std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(in)) + "->" + std::string(to_string(out)) + " f" +
               std::to_string(f) + " nnz " + std::to_string(g.nnz()));
  host_tensor h(in, g.rows, 1, f), want(dtype::f64, g.rows, 1, f);
  h.fill_uniform(-1, 1, seed);
  for (std::int64_t k = 0; k < f && g.rows > 3; ++k) h.set(3 * f + k, 0.0);  // a zero row
  agnn_layer::build(g).forward(h.view(), beta, want.view());
  const agnn_layer layer = agnn_layer::build(g, device_kind::cuda);
  test::device_tensor dh(h);
  check_runs(want, in, out, [&](const tensor_view& o) { layer.forward(dh.view(), beta, o); });
}

TEST(GpuLayers, GcnEveryTypeAndBothProductOrders) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(2000, 2000, 30, 3);
  for (const auto& [in, out] : std::vector<std::pair<dtype, dtype>>{{dtype::f16, dtype::f32},
                                                                    {dtype::bf16, dtype::bf16},
                                                                    {dtype::f32, dtype::f32},
                                                                    {dtype::f16, dtype::f16}}) {
    check_gcn(g, in, out, 128, 64, 1);  // x w first
    check_gcn(g, in, out, 32, 96, 2);   // Â x first
  }
  check_gcn(g, dtype::f32, dtype::f32, 5, 3, 3);  // odd widths
}

TEST(GpuLayers, AgnnEveryType) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(1500, 1500, 40, 4);
  for (const auto& [in, out] : std::vector<std::pair<dtype, dtype>>{
           {dtype::f16, dtype::f32}, {dtype::bf16, dtype::bf16}, {dtype::f32, dtype::f32}}) {
    check_agnn(g, in, out, 64, 1.0, 5);
    check_agnn(g, in, out, 100, -3.0, 6);
  }
}

TEST(GpuLayers, SharedDatasets) {
  SKIP_WITHOUT_GPU();
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  for (const auto& path : test::dataset_graphs()) {
    const std::string name = path.filename().string();
    if (name.find("cora") == std::string::npos && name.find("pubmed") == std::string::npos &&
        name.find("github") == std::string::npos)
      continue;
    SCOPED_TRACE(name);
    const csr_graph g = read_graph(path);
    check_gcn(g, dtype::f16, dtype::f32, 64, 16, 7);
    check_agnn(g, dtype::f16, dtype::f32, 32, 1.0, 8);
  }
}

TEST(GpuLayers, RejectWhatTheyCannotRun) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(100, 100, 5, 9);
  const gcn_layer gcn = gcn_layer::build(g, device_kind::cuda);
  test::device_tensor x(host_tensor(dtype::f16, 100, 1, 8)), w(host_tensor(dtype::f32, 8, 1, 4)),
      out(host_tensor(dtype::f32, 100, 1, 4)), out_bf(host_tensor(dtype::bf16, 100, 1, 8));
  EXPECT_THROW(gcn.forward(x.view(), w.view(), out.view()), invalid_input);  // mixed dtypes
  const agnn_layer agnn = agnn_layer::build(g, device_kind::cuda);
  EXPECT_THROW(agnn.forward(x.view(), 1.0, out_bf.view()), invalid_input);  // bf16 from f16
  host_tensor h(dtype::f16, 100, 1, 8), o(dtype::f32, 100, 1, 8);
  EXPECT_THROW(agnn.forward(h.view(), 1.0, o.view()), invalid_input);  // host tensors
}

}  // namespace
}  // namespace trisparse
