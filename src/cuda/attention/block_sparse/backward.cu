// The block-sparse backward's launches (kernels: backward.cuh): the per-row terms, then dq over
// the query tiles, then dk and dv over the key tiles, and on request the block importance's last
// step (importance.cuh), all on one stream; and the block mass without a backward (mass.cuh).
#include <string>

#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "backward.cuh"
#include "device_plan.cuh"
#include "dispatch.cuh"
#include "mass.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kFinishThreads = 128;

std::size_t terms_bytes(std::int64_t heads, std::int64_t rows) {
  return (static_cast<std::size_t>(2 * heads * rows) * sizeof(float) + 15) / 16 * 16;
}

// The block importance's partial sums: a slot per transposed entry (per head with a shared mask),
// key tile of its key block and warp of the dk/dv kernel, two floats each (the most warps any
// head dim takes: 4).
std::int64_t importance_slots(const block_sparse_device_plan& plan, std::int64_t heads) {
  return (plan.mask_heads == 1 ? heads : 1) * static_cast<std::int64_t>(plan.t_idx.size()) *
         (plan.block / plan.backward_tile_rows) * 4;
}

/// A block per (head, key tile) whose tile starts a key block: each thread takes entries of the
/// block's transposed column, adds their key tiles' warps' partials in order, and writes the mass
/// (per query row of the block) and the |dS| sum.
__global__ void importance_finish_kernel(const __grid_constant__ block_sparse::backward_params p,
                                         const __grid_constant__ block_sparse::importance_out o) {
  const int h = static_cast<int>(blockIdx.x / p.num_key_tiles);
  const block_sparse::tile t = p.key_tiles[blockIdx.x % p.num_key_tiles];
  if (t.row0 % p.block != 0) return;
  const int c = t.row0 / p.block;
  const std::int64_t lq = p.cu_q[t.seq + 1] - p.cu_q[t.seq];
  const std::int32_t* col =
      p.t_ptr + p.t_mask_col[t.seq * p.mask_heads + (p.mask_heads == 1 ? 0 : h)] + c;
  for (int e = col[0] + static_cast<int>(threadIdx.x); e < col[1];
       e += static_cast<int>(blockDim.x)) {
    const int r = p.t_idx[e];
    float m = 0.f, g = 0.f;
    const std::int64_t first = block_sparse::importance_slot(p, h, e);
    for (int x = 0; x < p.imp_sub * p.imp_warps; ++x) {
      const std::int64_t slot = first + x;
      m += p.imp_partial[2 * slot];
      g += p.imp_partial[2 * slot + 1];
    }
    const std::int64_t rows = min(std::int64_t{p.block}, lq - std::int64_t{r} * p.block);
    const std::int64_t at = t.seq * o.qb_max + r;
    if (o.mass != nullptr)
      o.mass[at * o.mass_row + h * o.mass_head + c] = rows > 0 ? m / static_cast<float>(rows) : 0.f;
    if (o.grad != nullptr) o.grad[at * o.grad_row + h * o.grad_head + c] = g;
  }
}

// What the key walks read (key_walk: the transposed masks and the key tiles) and the query rows.
void set_key_walk(block_sparse::backward_params& p, const block_sparse_device_plan& plan) {
  p.rows_q = plan.rows_q;
  p.t_mask_col = plan.t_mask_col.data();
  p.t_ptr = plan.t_ptr.data();
  p.t_idx = plan.t_idx.data();
  p.key_tiles = plan.key_tiles.data();
  p.num_key_tiles = plan.num_key_tiles;
}

// The block importance's partial sums at `at` (importance_slots(plan, heads) pairs of floats),
// zeroed on s: a key tile that sees none of a block's rows (the walk skips those query tiles)
// leaves its slots as they are. The dk/dv and mass kernels have a warp per 16 keys of a tile
// (wgmma: one warpgroup of 64).
void set_partials(block_sparse::backward_params& p, const block_sparse_device_plan& plan,
                  std::int64_t heads, void* at, cudaStream_t s) {
  p.imp_partial = static_cast<float*>(at);
  p.imp_slots = static_cast<std::int64_t>(plan.t_idx.size());
  p.imp_sub = static_cast<std::int32_t>(plan.block / plan.backward_tile_rows);
  p.imp_warps = static_cast<std::int32_t>(plan.backward_tile_rows / 16);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(
      p.imp_partial, 0, static_cast<std::size_t>(2 * importance_slots(plan, heads)) * 4, s));
}

// The importance's last kernel: the partials of each kept block added in order into the views.
void finish_importance(const block_sparse::backward_params& p, const block_sparse_device_plan& plan,
                       const block_importance_views& importance, std::int64_t heads,
                       cudaStream_t s) {
  if (plan.num_key_tiles == 0 || heads == 0) return;
  const block_sparse::importance_out o{static_cast<float*>(importance.mass.data),
                                       static_cast<float*>(importance.grad.data),
                                       importance.mass.row_stride,
                                       importance.mass.head_stride,
                                       importance.grad.row_stride,
                                       importance.grad.head_stride,
                                       importance.qb_max};
  importance_finish_kernel<<<static_cast<unsigned>(heads * plan.num_key_tiles), kFinishThreads, 0,
                             s>>>(p, o);
  TRISPARSE_CUDA_TRY(cudaGetLastError());
}

// The dq and dk/dv kernels at tile rows BM (the plan's backward tile: 16, 32 or 64). The streamed
// tiles hold BM rows too, except dk/dv at D = 128, whose two accumulators leave room for 32.
template <class T, int D, int BM, bool DROPOUT, bool BIAS>
void launch_gradients(const block_sparse::backward_params& p, const block_sparse_device_plan& plan,
                      cudaStream_t s) {
  constexpr int kThreads = BM / 16 * 32;
  constexpr int kKeyStream = D == 128 && BM > 32 ? 32 : BM;
  block_sparse::launch_kernel<
      block_sparse::backward_kernel<T, D, BM, BM, false, void, DROPOUT, BIAS>>(
      kThreads, block_sparse::backward_shared_bytes<D, BM, BM, false>(), p, plan.num_backward_tiles,
      s);
  block_sparse::launch_kernel<
      block_sparse::backward_kernel<T, D, BM, kKeyStream, true, void, DROPOUT, BIAS>>(
      kThreads, block_sparse::backward_shared_bytes<D, BM, kKeyStream, true>(), p,
      plan.num_key_tiles, s);
}

}  // namespace

std::size_t block_sparse_backward_workspace_bytes(const block_sparse_device_plan& plan,
                                                  std::int64_t heads, bool importance) {
  return terms_bytes(heads, plan.rows_q) +
         (importance ? static_cast<std::size_t>(2 * importance_slots(plan, heads)) * sizeof(float)
                     : 0);
}

void run_block_sparse_backward(const block_sparse_device_plan& plan, const tensor_view& q,
                               const tensor_view& k, const tensor_view& v, const tensor_view& out,
                               const tensor_view& lse, const tensor_view& dout,
                               const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                               double scale, const block_importance_views& importance,
                               const attention_dropout& dropout, const block_bias_views& bias,
                               workspace_view workspace, stream_ref stream) {
  const char* what = "the CUDA block-sparse backward";
  // dblock_bias: the importance's |dS| sums, signed, into bias.grad (no importance with it).
  TRISPARSE_EXPECTS_INPUT(bias.grad.data == nullptr || !importance.wanted(),
                          "block-sparse backward: block importance and dblock_bias together");
  const block_importance_views sums =
      bias.grad.data != nullptr ? block_importance_views{{}, bias.grad, bias.qb_max} : importance;
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
  const std::size_t need = block_sparse_backward_workspace_bytes(plan, q.heads, sums.wanted());
  TRISPARSE_EXPECTS_INPUT(workspace.data != nullptr && workspace.bytes >= need,
                          "block-sparse backward: the workspace holds " +
                              std::to_string(workspace.bytes) + " bytes, it needs " +
                              std::to_string(need) + " (backward_workspace_bytes" +
                              (sums.wanted() ? " with importance)" : ")"));
  block_sparse::backward_params p{};
  static_cast<block_sparse::params&>(p) = run_params(plan, q, k, v, out, lse, scale);
  p.tiles = plan.backward_tiles.data();
  p.num_tiles = plan.num_backward_tiles;
  block_sparse::set_gradient_io(p, dout, dq, dk, dv, scale);
  block_sparse::set_dropout(p, dropout);
  block_sparse::set_block_bias(p, bias.bias, bias.qb_max);
  p.imp_signed = bias.grad.data != nullptr;
  auto* terms = static_cast<float*>(workspace.data);
  p.lse2 = terms;
  p.dterm = terms + q.heads * plan.rows_q;
  set_key_walk(p, plan);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (sums.wanted()) {
    set_partials(p, plan, q.heads,
                 static_cast<char*>(workspace.data) + terms_bytes(q.heads, plan.rows_q), s);
    p.imp_grad = sums.grad.data != nullptr;
  }
  with_half_type(q.type, "block-sparse backward's q", [&]<class T>() {
    block_sparse::launch_backward_terms<T>(p, out.type, static_cast<int>(v.dim), terms, s);
#if TRISPARSE_HAVE_SM90A
    if (plan.wgmma && plan.backward_tile_rows == 64 && block_sparse::wgmma_backward_takes(q.dim)) {
      return block_sparse::launch_wgmma_backward(q.type, q.dim, p, plan.num_backward_tiles,
                                                 plan.num_key_tiles, dropout, s);
    }
#endif
    with_head_dim<64, 128>(q.dim, "the CUDA block-sparse backward's head_dim", [&]<int D>() {
      block_sparse::with_dropout_or_bias(
          dropout, p.block_bias != nullptr, [&]<bool DROPOUT, bool BIAS>() {
            switch (plan.backward_tile_rows) {
              case 16:
                return launch_gradients<T, D, 16, DROPOUT, BIAS>(p, plan, s);
              case 32:
                return launch_gradients<T, D, 32, DROPOUT, BIAS>(p, plan, s);
              default:
                return launch_gradients<T, D, 64, DROPOUT, BIAS>(p, plan, s);
            }
          });
    });
  });
  if (sums.wanted()) finish_importance(p, plan, sums, q.heads, s);
}

std::size_t block_sparse_mass_workspace_bytes(const block_sparse_device_plan& plan,
                                              std::int64_t heads) {
  return static_cast<std::size_t>(2 * importance_slots(plan, heads)) * sizeof(float);
}

void run_block_sparse_mass(const block_sparse_device_plan& plan, const tensor_view& q,
                           const tensor_view& k, const tensor_view& lse, double scale,
                           const block_importance_views& importance, workspace_view workspace,
                           stream_ref stream) {
  const char* what = "the CUDA block mass";
  TRISPARSE_EXPECTS_INPUT(plan.gradients,
                          "block mass: this plan was built without the transposed masks "
                          "(block_sparse_plan_options::gradients = true)");
  check_16bit_inputs(q, k, k, what);
  check_16byte_rows(q, "q");
  check_16byte_rows(k, "k");
  TRISPARSE_EXPECTS_INPUT(lse.data != nullptr && lse.type == dtype::f32,
                          "block mass needs the forward's lse (f32; run() with "
                          "attention_options::lse)");
  TRISPARSE_EXPECTS_INPUT(importance.mass.data != nullptr && importance.grad.data == nullptr,
                          "block mass writes attention_options::block_mass only (block_grad "
                          "needs a backward)");
  expect_current_device(plan.device);
  const std::size_t need = block_sparse_mass_workspace_bytes(plan, q.heads);
  TRISPARSE_EXPECTS_INPUT(workspace.data != nullptr && workspace.bytes >= need,
                          "block mass: the workspace holds " + std::to_string(workspace.bytes) +
                              " bytes, it needs " + std::to_string(need) +
                              " (block_mass_workspace_bytes)");
  block_sparse::backward_params p{};
  static_cast<block_sparse::params&>(p) = run_params(plan, q, k, k, q, lse, scale);  // (no v, out)
  set_key_walk(p, plan);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const int rows = static_cast<int>(plan.backward_tile_rows);
  set_partials(p, plan, q.heads, workspace.data, s);
  with_half_type(q.type, "block mass's q", [&]<class T>() {
    with_head_dim<64, 128>(q.dim, "the CUDA block mass's head_dim", [&]<int D>() {
      with_value<16, 32, 64>(rows, "the block mass's key tile rows", [&]<int BM>() {
        block_sparse::launch_kernel<block_sparse::mass_kernel<T, D, BM>>(
            BM / 16 * 32, block_sparse::mass_shared_bytes<D, BM>(), p, plan.num_key_tiles, s);
      });
    });
  });
  finish_importance(p, plan, importance, q.heads, s);
}

}  // namespace trisparse::cuda
