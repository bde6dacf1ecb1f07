// The block-sparse backward's launches (kernels: backward.cuh): the per-row terms, then dq over
// the query tiles, then dk and dv over the key tiles, all on one stream.
#include <string>

#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "backward.cuh"
#include "device_plan.cuh"
#include "dispatch.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kTermThreads = 256;  // 8 rows x heads items a block of the terms kernel

std::size_t terms_bytes(std::int64_t heads, std::int64_t rows) {
  return static_cast<std::size_t>(2 * heads * rows) * sizeof(float);
}

// The dq and dk/dv kernels at tile rows BM (the plan's backward tile: 16, 32 or 64). The streamed
// tiles hold BM rows too, except dk/dv at D = 128, whose two accumulators leave room for 32.
template <class T, int D, int BM>
void launch_gradients(const block_sparse::backward_params& p, const block_sparse_device_plan& plan,
                      cudaStream_t s) {
  constexpr int kThreads = BM / 16 * 32;
  constexpr int kKeyStream = D == 128 && BM > 32 ? 32 : BM;
  block_sparse::launch_kernel<block_sparse::backward_kernel<T, D, BM, BM, false>>(
      kThreads, block_sparse::backward_shared_bytes<D, BM, BM, false>(), p, plan.num_backward_tiles,
      s);
  block_sparse::launch_kernel<block_sparse::backward_kernel<T, D, BM, kKeyStream, true>>(
      kThreads, block_sparse::backward_shared_bytes<D, BM, kKeyStream, true>(), p,
      plan.num_key_tiles, s);
}

}  // namespace

std::size_t block_sparse_backward_workspace_bytes(const block_sparse_device_plan& plan,
                                                  std::int64_t heads) {
  return terms_bytes(heads, plan.rows_q);
}

void run_block_sparse_backward(const block_sparse_device_plan& plan, const tensor_view& q,
                               const tensor_view& k, const tensor_view& v, const tensor_view& out,
                               const tensor_view& lse, const tensor_view& dout,
                               const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                               double scale, workspace_view workspace, stream_ref stream) {
  const char* what = "the CUDA block-sparse backward";
  TRISPARSE_EXPECTS_INPUT(plan.gradients,
                          "block-sparse backward: this plan was built without gradients "
                          "(block_sparse_plan_options::gradients = true)");
  check_attention_operands(q, k, v, dout, what);
  TRISPARSE_EXPECTS_INPUT(dout.type == q.type, "dout must have q's dtype (" +
                                                   std::string(to_string(q.type)) + "), not " +
                                                   std::string(to_string(dout.type)));
  TRISPARSE_EXPECTS_INPUT(
      out.type == q.type || out.type == dtype::f32,
      "out must have q's dtype or f32, not " + std::string(to_string(out.type)));
  TRISPARSE_EXPECTS_INPUT(lse.data != nullptr && lse.type == dtype::f32,
                          "block-sparse backward needs the forward's lse (f32; run() with "
                          "attention_options::lse)");
  const bool f32 = dq.type == dtype::f32;
  for (const auto* g : {&dq, &dk, &dv}) {
    TRISPARSE_EXPECTS_INPUT(g->type == dq.type && (f32 || g->type == q.type),
                            "dq, dk and dv must all have q's dtype or all be f32");
  }
  check_16byte_rows(dq, "dq");
  check_16byte_rows(dk, "dk");
  check_16byte_rows(dv, "dv");
  expect_current_device(plan.device);
  const std::size_t need = terms_bytes(q.heads, plan.rows_q);
  TRISPARSE_EXPECTS_INPUT(workspace.data != nullptr && workspace.bytes >= need,
                          "block-sparse backward: the workspace holds " +
                              std::to_string(workspace.bytes) + " bytes, it needs " +
                              std::to_string(need) + " (block_sparse_backward_workspace_bytes)");
  block_sparse::backward_params p{};
  static_cast<block_sparse::params&>(p) = run_params(plan, q, k, v, out, lse, scale);
  p.tiles = plan.backward_tiles.data();
  p.num_tiles = plan.num_backward_tiles;
  p.dout = dout.data;
  p.do_row = dout.row_stride;
  p.do_head = dout.head_stride;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  p.dq_row = dq.row_stride;
  p.dq_head = dq.head_stride;
  p.dk_row = dk.row_stride;
  p.dk_head = dk.head_stride;
  p.dv_row = dv.row_stride;
  p.dv_head = dv.head_stride;
  p.grads_f32 = f32;
  p.scale = static_cast<float>(scale);
  auto* terms = static_cast<float*>(workspace.data);
  p.lse2 = terms;
  p.dterm = terms + q.heads * plan.rows_q;
  p.rows_q = plan.rows_q;
  p.t_mask_col = plan.t_mask_col.data();
  p.t_ptr = plan.t_ptr.data();
  p.t_idx = plan.t_idx.data();
  p.key_tiles = plan.key_tiles.data();
  p.num_key_tiles = plan.num_key_tiles;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_half_type(q.type, "block-sparse backward's q", [&]<class T>() {
    const std::int64_t items = plan.rows_q * q.heads;
    if (items > 0) {
      const auto blocks =
          static_cast<unsigned>((items + kTermThreads / 32 - 1) / (kTermThreads / 32));
      const auto terms_kernel = [&]<class Out>() {
        block_sparse::backward_terms_kernel<T, Out>
            <<<blocks, kTermThreads, 0, s>>>(p, static_cast<int>(v.dim), terms);
        TRISPARSE_CUDA_TRY(cudaGetLastError());
      };
      if (out.type == dtype::f32)
        terms_kernel.template operator()<float>();
      else
        terms_kernel.template operator()<T>();
    }
#if TRISPARSE_HAVE_SM90A
    if (plan.wgmma && plan.backward_tile_rows == 64 && block_sparse::wgmma_backward_takes(q.dim)) {
      return block_sparse::launch_wgmma_backward(q.type, q.dim, p, plan.num_backward_tiles,
                                                 plan.num_key_tiles, s);
    }
#endif
    with_head_dim<64, 128>(q.dim, "the CUDA block-sparse backward's head_dim", [&]<int D>() {
      switch (plan.backward_tile_rows) {
        case 16:
          return launch_gradients<T, D, 16>(p, plan, s);
        case 32:
          return launch_gradients<T, D, 32>(p, plan, s);
        default:
          return launch_gradients<T, D, 64>(p, plan, s);
      }
    });
  });
}

}  // namespace trisparse::cuda
