// Float64 GAT attention and its gradients over a pattern: the multigraph references (edge.cpp)
// over the pattern's entries in CSR order, so that entry e is edge e (keep's rows line up). The
// oracle of gat_plan's kernels; checked against finite differences (tests/unit/backward_test.cpp).
#include "trisparse/ops/reference.hpp"

namespace trisparse::reference {

namespace {

// The pattern's entries as edges (src: row, dst: column), in CSR order.
coo_graph entries_of(const csr_graph& a) {
  a.check();
  return to_coo(a);
}

}  // namespace

void gat(const csr_graph& a, const tensor_view& x, const tensor_view& a_src,
         const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
         const tensor_view& out, const tensor_view& lse) {
  edge_gat(entries_of(a), x, a_src, a_dst, {}, keep, negative_slope, out, lse);
}

void gat_backward(const csr_graph& a, const tensor_view& x, const tensor_view& a_src,
                  const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& da_src,
                  const tensor_view& da_dst) {
  edge_gat_backward(entries_of(a), x, a_src, a_dst, {}, keep, negative_slope, dout, dx, da_src,
                    da_dst, {});
}

}  // namespace trisparse::reference
