// Attention within segments (segment_attention_plan): argument checks, then the CUDA kernels.
#include "trisparse/ops/segment_attention.hpp"

#include <cstdint>
#include <string>
#include <utility>

#include "../common/arguments.hpp"
#include "../cuda/attention/segments/plan.hpp"
#include "../cuda/common/layout.hpp"
#include "layers/common.hpp"

namespace trisparse {

namespace {

constexpr const char* kWhat = "attention within segments";
// Rows a plan takes: tiles of 64 rows must not pass the int32 row index.
constexpr std::int64_t kMaxRows = (std::int64_t{1} << 31) - 64;

// q, k, v: [rows, H, D] on the device, one 16-bit dtype, D a dim the kernels take.
void check_operands(const segment_view& seg, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v) {
  check_view(q, "q", seg.rows, -1, -1);
  check_view(k, "k", seg.rows, q.heads, q.dim);
  check_view(v, "v", seg.rows, q.heads, q.dim);
  for (const auto& [t, what] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    detail::check_device_arg(*t, what);
    TRISPARSE_EXPECTS_INPUT(t->device_id == seg.device_id,
                            std::string(what) + " is on device " + std::to_string(t->device_id) +
                                ", the segment ids on " + std::to_string(seg.device_id));
    cuda::check_16byte_rows(*t, what);
  }
  cuda::check_16bit_inputs(q, k, v, kWhat);
  if (!segment_attention_plan::supports(q.dim))
    throw not_supported(std::string(kWhat) +
                        " takes head dims 16, 32, 64 and 128 (those built), not " +
                        std::to_string(q.dim));
}

void check_output(const tensor_view& t, const char* what, const tensor_view& q) {
  check_view(t, what, q.rows, q.heads, q.dim);
  detail::check_device_arg(t, what);
  TRISPARSE_EXPECTS_INPUT(t.type == q.type || t.type == dtype::f32,
                          std::string(what) + " " + t.describe() + " must be f32 or q's dtype");
  cuda::check_16byte_rows(t, what);
}

void check_lse(const tensor_view& lse, const tensor_view& q) {
  check_view(lse, "lse", q.rows, q.heads, 1);
  detail::check_device_arg(lse, "lse");
  TRISPARSE_EXPECTS_INPUT(lse.type == dtype::f32, "lse " + lse.describe() + " must be f32");
}

// options: dropout, the pair bias (f32 [rows, H or 1, M]; with edges [E, H or 1, 1]) and, for
// backward(), its gradient (f32 [rows, H, M]; [E, H, 1]); no block bias or block importance.
void check_options(const attention_options& o, const tensor_view& q, const segment_edges& edges,
                   bool backward) {
  const bool by_edge = edges.query_ptr != nullptr;
  const std::int64_t bias_rows = by_edge ? edges.edges : q.rows;
  TRISPARSE_EXPECTS_INPUT(
      o.block_mass.data == nullptr && o.block_grad.data == nullptr &&
          o.block_bias.data == nullptr && o.dblock_bias.data == nullptr,
      std::string(kWhat) + " takes no block bias and writes no block importance");
  TRISPARSE_EXPECTS_INPUT(backward || o.dbias.data == nullptr,
                          std::string(kWhat) + ": dbias is backward()'s");
  TRISPARSE_EXPECTS_INPUT(o.dbias.data == nullptr || o.bias.data != nullptr,
                          std::string(kWhat) + ": dbias needs the bias it is the gradient of");
  if (o.bias.data != nullptr) {
    check_view(o.bias, "bias", bias_rows, -1, by_edge ? 1 : -1);
    detail::check_device_arg(o.bias, "bias");
    TRISPARSE_EXPECTS_INPUT(o.bias.device_id == q.device_id, "bias must be on q's device");
    TRISPARSE_EXPECTS_INPUT(o.bias.type == dtype::f32,
                            "bias " + o.bias.describe() + " must be f32");
    TRISPARSE_EXPECTS_INPUT(o.bias.heads == q.heads || o.bias.heads == 1,
                            "bias " + o.bias.describe() + " must have q's " +
                                std::to_string(q.heads) + " heads or 1 (shared)");
    TRISPARSE_EXPECTS_INPUT(o.bias.dim >= 1, "bias " + o.bias.describe() +
                                                 " needs M >= 1 (the longest segment's rows)");
  }
  if (o.dbias.data != nullptr) {
    check_view(o.dbias, "dbias", bias_rows, q.heads, o.bias.dim);
    detail::check_device_arg(o.dbias, "dbias");
    TRISPARSE_EXPECTS_INPUT(o.dbias.device_id == q.device_id, "dbias must be on q's device");
    TRISPARSE_EXPECTS_INPUT(o.dbias.type == dtype::f32,
                            "dbias " + o.dbias.describe() + " must be f32");
  }
  detail::check_dropout(o.dropout);
}

void check_workspace(workspace_view w, std::size_t need, const char* call) {
  TRISPARSE_EXPECTS_INPUT(w.bytes >= need && (w.data != nullptr || need == 0),
                          std::string(kWhat) + ": " + call + " needs " + std::to_string(need) +
                              " bytes of workspace, got " + std::to_string(w.bytes));
}

}  // namespace

segment_attention_plan segment_attention_plan::build(const segment_view& segments,
                                                     const segment_edges& edges) {
  TRISPARSE_EXPECTS_INPUT(
      segments.rows >= 0 && segments.rows < kMaxRows,
      "segments: rows must be in [0, 2^31 - 64), got " + std::to_string(segments.rows));
  TRISPARSE_EXPECTS_INPUT(segments.rows == 0 || segments.ids != nullptr,
                          "segments: the ids are missing");
  if (edges.query_ptr != nullptr) {
    TRISPARSE_EXPECTS_INPUT(
        edges.edges >= 0 && edges.edges < (std::int64_t{1} << 31),
        "edges: the count must be in [0, 2^31), got " + std::to_string(edges.edges));
    TRISPARSE_EXPECTS_INPUT(
        edges.key_ptr != nullptr &&
            (edges.edges == 0 || (edges.query_key != nullptr && edges.query_edge != nullptr &&
                                  edges.key_query != nullptr && edges.key_edge != nullptr)),
        "edges: query_ptr is set, so the lists by query and by key must all be");
  }
  segment_attention_plan plan;
  plan.segments_ = segments;
  plan.edges_ = edges;
  return plan;
}

bool segment_attention_plan::supports(std::int64_t head_dim) {
#if TRISPARSE_HAVE_CUDA
  return cuda::segment_attention_takes(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

std::size_t segment_attention_plan::workspace_bytes() const {
  return cuda::segment_bounds_bytes(segments_.rows);
}

std::size_t segment_attention_plan::backward_workspace_bytes(std::int64_t heads) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 1, "segment attention needs heads >= 1");
  return workspace_bytes() + static_cast<std::size_t>(2 * heads * segments_.rows) * sizeof(float);
}

void segment_attention_plan::run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                 const tensor_view& out, const attention_options& options,
                                 workspace_view workspace, stream_ref stream) const {
  check_operands(segments_, q, k, v);
  check_output(out, "out", q);
  if (options.lse.data != nullptr) check_lse(options.lse, q);
  check_options(options, q, edges_, false);
  check_workspace(workspace, workspace_bytes(), "run()");
  cuda::segment_attention_forward(segments_, edges_, q, k, v, out, options.lse,
                                  effective_scale(options, q.dim), options.dropout, options.bias,
                                  workspace, stream);
}

void segment_attention_plan::backward(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const tensor_view& lse, const tensor_view& dout,
                                      const tensor_view& dq, const tensor_view& dk,
                                      const tensor_view& dv, const attention_options& options,
                                      workspace_view workspace, stream_ref stream) const {
  check_operands(segments_, q, k, v);
  check_output(out, "out", q);
  check_lse(lse, q);
  check_view(dout, "dout", q.rows, q.heads, q.dim);
  detail::check_device_arg(dout, "dout");
  TRISPARSE_EXPECTS_INPUT(dout.type == q.type, "dout " + dout.describe() + " must have q's dtype");
  cuda::check_16byte_rows(dout, "dout");
  for (const auto& [t, what] : {std::pair{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}) {
    check_output(*t, what, q);
    TRISPARSE_EXPECTS_INPUT(t->type == dq.type, "dq, dk and dv must all be f32 or all q's dtype");
  }
  check_options(options, q, edges_, true);
  check_workspace(workspace, backward_workspace_bytes(q.heads), "backward()");
  cuda::segment_attention_backward(segments_, edges_, q, k, v, out, lse, dout, dq, dk, dv,
                                   effective_scale(options, q.dim), options.dropout, options.bias,
                                   options.dbias, workspace, stream);
}

}  // namespace trisparse
