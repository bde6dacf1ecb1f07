#pragma once
// What the GNN layers' plans share (internal): argument checks, the float64 host GEMM of the CPU
// paths, the binary pattern with self loops, and layer_core (the pattern or sparse plan and the
// layer's own workspace).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "../../common/workspace_layout.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/layers.hpp"
#include "trisparse/ops/sparse.hpp"

namespace trisparse::detail {

// The binary pattern of a square graph with (i, i) in every row when `add_self_loops`.
inline csr_graph with_self_loops(const csr_graph& g, bool add_self_loops) {
  g.check();
  TRISPARSE_EXPECTS_INPUT(g.rows == g.cols, "a GNN layer needs a square graph; this one is " +
                                                std::to_string(g.rows) + " x " +
                                                std::to_string(g.cols));
  csr_graph a;
  a.rows = a.cols = g.rows;
  a.row_ptr.assign(1, 0);
  a.row_ptr.reserve(g.row_ptr.size());
  a.col_idx.reserve(g.col_idx.size() + (add_self_loops ? g.col_idx.size() : 0));
  for (std::int64_t r = 0; r < g.rows; ++r) {
    bool placed = !add_self_loops;
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      const std::int32_t c = g.col_idx[e];
      if (!placed && c >= r) {  // columns are sorted: the loop goes before the first c >= r
        if (c != r) a.col_idx.push_back(static_cast<std::int32_t>(r));
        placed = true;
      }
      a.col_idx.push_back(c);
    }
    if (!placed) a.col_idx.push_back(static_cast<std::int32_t>(r));
    a.row_ptr.push_back(a.nnz());
  }
  return a;
}

inline void check_host(const tensor_view& t, const char* what) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cpu,
                          std::string(what) + " " + t.describe() + " must be on the CPU");
}

inline void check_device_arg(const tensor_view& t, const char* what) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cuda,
                          std::string(what) + " " + t.describe() + " must be on the GPU");
}

// What both layers hold: the pattern (CPU) or its sparse plan (CUDA), and on CUDA the workspace
// of runs not given one, sized at build for `own_dim` wide features.
struct layer_core {
  device_kind where = device_kind::cpu;
  csr_graph pattern;                // CPU layers: Â (GCN) or A + I (AGNN)
  std::optional<sparse_plan> plan;  // CUDA layers
  std::int64_t rows = 0, nnz = 0;
  device_tensor own;
  std::int64_t own_dim = 0;

  // `own_bytes(plan, rows, dim)`: the layer's workspace for features `dim` wide.
  template <class Bytes>
  layer_core(csr_graph a, device_kind w, const layer_options& options, stream_ref stream,
             Bytes&& own_bytes)
      : where(w), rows(a.rows), nnz(a.nnz()) {
    if (where == device_kind::cpu) {
      pattern = std::move(a);
      return;
    }
    plan = sparse_plan::build(
        a, where,
        {.order = options.order, .workspace_heads = 1, .workspace_dim = options.workspace_dim},
        stream);
    own_dim = std::max<std::int64_t>(options.workspace_dim, 1);
    own = device_tensor(dtype::f32,
                        static_cast<std::int64_t>((own_bytes(*plan, rows, own_dim) + 3) / 4), 1, 1);
  }

  // The workspace a run uses: the caller's, checked, or the layer's own, which must hold the
  // run's layout.
  workspace_view use(const detail::workspace_layout& layout, const workspace_view& given,
                     const char* what) const {
    if (!given.empty()) {
      layout.check(given, what);
      return given;
    }
    const tensor_view o = own.view();
    const workspace_view ws{o.data, static_cast<std::size_t>(o.rows) * 4};
    TRISPARSE_EXPECTS_INPUT(layout.bytes() <= ws.bytes,
                            std::string(what) +
                                ": the layer's own workspace serves features up to " +
                                std::to_string(own_dim) +
                                " wide: build it with a larger layer_options.workspace_dim, or "
                                "pass a workspace to forward()");
    return ws;
  }
};

}  // namespace trisparse::detail
