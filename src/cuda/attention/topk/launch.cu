// Top-k block masks on the device (block routing, as topk_block_mask defines them on the CPU):
// one launch pools the block means of Q and K, one selects per (query block, head) the top_k key
// blocks by <mean Q, mean K> among those the block may attend, adds the diagonal block, and writes
// them in ascending order into the attention plan's blocks. Rows have fixed room (top_k + 1
// slots); unused slots hold the sequence's key-block count, whose first key lies past every
// row's last, so the attention kernels' walk ends there. No host synchronisation.
// Layout: params.hpp (plain data), tuning.hpp (tile shapes), pool_kernel.cuh, warp_select.cuh,
// select_kernel.cuh; this file holds the device plan, its build and the launches.
#include <algorithm>
#include <bit>
#include <string>
#include <vector>

#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "../block_sparse/device_plan.cuh"
#include "../block_sparse/plan.hpp"
#include "pool_kernel.cuh"
#include "select_kernel.cuh"

namespace trisparse::cuda {

using namespace topk;

struct topk_device_plan {
  std::shared_ptr<block_sparse_device_plan> attention;
  std::int32_t heads = 0, dim = 0, pdim = 0, block = 0, top_k = 0, cap = 0;  // pdim: pooled_dim
  bool causal = false, keep_diagonal = false;
  std::int32_t q_blocks = 0, k_blocks = 0, max_k_blocks = 0, rows = 0, num_groups = 0;
  std::int32_t held = 0;  // keys a lane holds in registers in the selection (0: shared memory)
  bool dependent_launch = false;   // the selection as a programmatic dependent of the pooling
  std::int32_t select_shared = 0;  // a selection block's shared bytes
  unsigned pool_grid = 0;          // the pooling's blocks: one wave, or fewer where the tasks are
  std::int32_t pool_shared = 0;    // the pooling's shared bytes
  std::int64_t rows_q = 0, rows_k = 0;
  device_buffer<pool_block> pool_blocks;  // the query blocks', then the key blocks' rows
  device_buffer<select_group> groups;     // the selection's blocks
  // [blocks, heads] rows of pooled_bytes(pdim): the means as digits and a scale (pooled_dim)
  device_buffer<std::uint8_t> pooled_q, pooled_k;
};

namespace {

// The selection kernel holding R keys per lane in registers: the fewest that cover max_k_blocks,
// up to 32 (1024 key blocks); beyond, R = 0 (keys read from shared memory in every pass). The
// A fragments in registers where the pooled dim is 64 (head dims 33-64); other dims read them at
// every k-step.
using select_fn = void (*)(select_params);
select_fn select_kernel_for(int held, int pdim) {
  select_fn fn = nullptr;
  with_value<0, 2, 4, 8, 16, 32>(held, "top-k selection's keys a lane holds", [&]<int R>() {
    fn = pdim == 64 ? select_kernel<R, 64> : select_kernel<R, 0>;
  });
  return fn;
}

int held_keys(int max_k_blocks) {
  for (const int r : {2, 4, 8, 16, 32})
    if (32 * r >= max_k_blocks) return r;
  return 0;
}

void check_input(const topk_device_plan& t, const tensor_view& v, std::int64_t rows,
                 const char* name) {
  if (v.where != device_kind::cuda || v.rows != rows || v.heads != t.heads || v.dim != t.dim ||
      (v.type != dtype::f16 && v.type != dtype::bf16)) {
    throw invalid_input(std::string("top-k selection: ") + name + " must be a CUDA f16 or bf16 [" +
                        std::to_string(rows) + ", " + std::to_string(t.heads) + ", " +
                        std::to_string(t.dim) + "] tensor");
  }
  check_16byte_rows(v, name);
}

}  // namespace

std::shared_ptr<topk_device_plan> make_topk_plan(const block_sparse_mask& skeleton,
                                                 std::int64_t top_k, bool keep_diagonal,
                                                 std::int64_t dim, block_kernel kernel,
                                                 bool gradients, stream_ref stream) {
  if (dim % 8 != 0) {
    throw invalid_input("top-k selection: head_dim must be a multiple of 8, not " +
                        std::to_string(dim));
  }
  auto t = std::make_shared<topk_device_plan>();
  t->attention = make_block_sparse_plan(skeleton, kernel, false, stream);
  if (gradients)
    prepare_topk_backward(*t->attention, skeleton, top_k + (keep_diagonal ? 1 : 0), stream);
  t->heads = static_cast<std::int32_t>(skeleton.heads);
  t->dim = static_cast<std::int32_t>(dim);
  t->pdim = pooled_dim(t->dim);
  t->block = static_cast<std::int32_t>(skeleton.block);
  t->top_k = static_cast<std::int32_t>(top_k);
  t->cap = static_cast<std::int32_t>(top_k + (keep_diagonal ? 1 : 0));
  t->causal = skeleton.causal;
  t->keep_diagonal = keep_diagonal;
  t->rows_q = skeleton.cu_seqlens_q.back();
  t->rows_k = skeleton.cu_seqlens_k.back();
  std::vector<pool_block> q_blocks, k_blocks;
  std::vector<std::int32_t> q_base, k_base;
  // Each sequence's blocks of `block` rows (the last one shorter), from its first row in cu.
  const auto add_blocks = [&](const std::vector<std::int64_t>& cu, std::int64_t b,
                              std::vector<pool_block>& blocks, std::vector<std::int32_t>& base) {
    base.push_back(static_cast<std::int32_t>(blocks.size()));
    for (std::int64_t r = cu[b]; r < cu[b + 1]; r += t->block)
      blocks.push_back(
          {r, static_cast<std::int32_t>(std::min<std::int64_t>(t->block, cu[b + 1] - r))});
    return static_cast<std::int32_t>(blocks.size()) - base.back();
  };
  for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
    add_blocks(skeleton.cu_seqlens_q, b, q_blocks, q_base);
    t->max_k_blocks =
        std::max(t->max_k_blocks, add_blocks(skeleton.cu_seqlens_k, b, k_blocks, k_base));
  }
  t->q_blocks = static_cast<std::int32_t>(q_blocks.size());
  t->k_blocks = static_cast<std::int32_t>(k_blocks.size());
  // Query blocks per selection block: the most of 32, 16, ..., 1 whose scores fit in shared
  // memory, then halved (down to 4) while the blocks would not cover half the SMs (a block of 32
  // rows runs 16 warps: one fills an SM's warps as two blocks of 16 rows do).
  int device = 0, limit = 0, sms = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  t->held = held_keys(t->max_k_blocks);
  for (int rows = kMaxRows; rows >= 1 && t->rows == 0; rows /= 2)
    if (select_bytes(rows, t->pdim, score_floats(t->held, t->max_k_blocks)) <= limit)
      t->rows = rows;
  if (t->rows == 0) {
    throw not_supported("top-k selection: " + std::to_string(t->max_k_blocks) +
                        " key blocks in one sequence need more shared memory than the device has");
  }
  const auto groups_of = [&](int rows) {
    std::vector<select_group> groups;
    for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
      const auto lq = static_cast<std::int32_t>(skeleton.len_q(b)),
                 lk = static_cast<std::int32_t>(skeleton.cu_seqlens_k[b + 1] -
                                                skeleton.cu_seqlens_k[b]);
      const int nbq = (lq + t->block - 1) / t->block;
      const auto at = static_cast<std::size_t>(b);
      for (int r = 0; r < nbq; r += rows) groups.push_back({q_base[at], k_base[at], r, lq, lk});
    }
    return groups;
  };
  while (t->rows > 4 && static_cast<std::int64_t>(groups_of(t->rows).size()) * t->heads * 2 < sms)
    t->rows /= 2;
  const std::vector<select_group> groups = groups_of(t->rows);
  // Launched as dependents (sm_90), the selection's blocks take an SM as the pooling leaves it
  // and start before it ends (a stream-ordered launch starts about 2 us later). Blocks of 32 rows
  // (16 warps, most of an SM's shared memory) take an SM each. Smaller blocks would be placed two
  // to the SMs that the pooling leaves first while other SMs stay empty, so they are launched as
  // dependents only where they are one wave or less, each given more than half an SM's shared
  // memory; else they wait in stream order.
  t->select_shared = select_bytes(t->rows, t->pdim, score_floats(t->held, t->max_k_blocks));
  const bool can_depend = arch::waits_for_primary(select_kernel_for(t->held, t->pdim));
  t->dependent_launch = can_depend && t->rows == kMaxRows;
  if (can_depend && t->rows < kMaxRows &&
      static_cast<std::int64_t>(groups.size()) * t->heads <= sms) {
    t->dependent_launch = true;
    t->select_shared = std::max(t->select_shared, dependent_select_shared(limit));
  }
  TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(select_kernel_for(t->held, t->pdim),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          t->select_shared));
  t->num_groups = static_cast<std::int32_t>(groups.size());
  t->groups = device_buffer<select_group>(groups);
  q_blocks.insert(q_blocks.end(), k_blocks.begin(), k_blocks.end());
  t->pool_blocks = device_buffer<pool_block>(q_blocks);
  // The pooling's persistent warps: as many blocks as fit at once, or one per kPoolThreads / 32
  // tasks where fewer.
  t->pool_shared = kPoolThreads / 32 * pool_warp_floats(t->pdim) * 4;
  if (t->pool_shared > limit) {
    throw not_supported("top-k selection: head_dim " + std::to_string(t->dim) +
                        " needs more shared memory for the pooling than the device has");
  }
  for (const auto pool : {pool_kernel<__half>, pool_kernel<__nv_bfloat16>}) {
    TRISPARSE_CUDA_TRY(
        cudaFuncSetAttribute(pool, cudaFuncAttributeMaxDynamicSharedMemorySize, t->pool_shared));
  }
  int pool_per_sm = 0;
  TRISPARSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &pool_per_sm, pool_kernel<__half>, kPoolThreads, t->pool_shared));
  const std::int64_t pool_tasks = std::int64_t{t->q_blocks + t->k_blocks} * t->heads;
  t->pool_grid = static_cast<unsigned>(
      std::min<std::int64_t>((pool_tasks + kPoolThreads / 32 - 1) / (kPoolThreads / 32),
                             std::int64_t{std::max(1, pool_per_sm)} * sms));
  const auto row_bytes = static_cast<std::size_t>(pooled_bytes(t->pdim));
  t->pooled_q =
      device_buffer<std::uint8_t>(static_cast<std::size_t>(t->q_blocks) * t->heads * row_bytes);
  t->pooled_k =
      device_buffer<std::uint8_t>(static_cast<std::size_t>(t->k_blocks) * t->heads * row_bytes);
  // The rows' padding past the scale is copied with it but never read; zeroed once. Done before
  // the plan is returned, whatever stream select() runs on later.
  for (auto* pooled : {&t->pooled_q, &t->pooled_k}) {
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(pooled->data(), 0, pooled->size(),
                                       static_cast<cudaStream_t>(stream.handle)));
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  return t;
}

const block_sparse_device_plan& attention_of(const topk_device_plan& t) { return *t.attention; }

void select_topk(topk_device_plan& t, const tensor_view& q, const tensor_view& k,
                 stream_ref stream) {
  check_input(t, q, t.rows_q, "q");
  check_input(t, k, t.rows_k, "k");
  if (k.type != q.type) throw invalid_input("top-k selection: q and k need the same dtype");
  expect_current_device(t.attention->device);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  block_sparse_device_plan& a = *t.attention;
  const pool_params pp{q.data,
                       k.data,
                       q.row_stride,
                       q.head_stride,
                       k.row_stride,
                       k.head_stride,
                       t.pool_blocks.data(),
                       t.pooled_q.data(),
                       t.pooled_k.data(),
                       t.q_blocks,
                       t.q_blocks + t.k_blocks,
                       t.heads,
                       t.dim,
                       t.pdim};
  // The backward's transposed masks follow the selection in stream order (also when nothing is
  // selected: their offsets are written all the same).
  if (t.pool_grid == 0) {
    if (a.gradients) transpose_on_device(a, s);
    return;
  }
  if (q.type == dtype::f16)
    pool_kernel<__half><<<t.pool_grid, kPoolThreads, t.pool_shared, s>>>(pp);
  else
    pool_kernel<__nv_bfloat16><<<t.pool_grid, kPoolThreads, t.pool_shared, s>>>(pp);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  select_params sp{};
  sp.pooled_q = t.pooled_q.data();
  sp.pooled_k = t.pooled_k.data();
  sp.groups = t.groups.data();
  sp.col_idx = a.col_idx.data();
  sp.heads = t.heads;
  sp.pdim = t.pdim;
  sp.block = t.block;
  sp.block_shift =
      (t.block & (t.block - 1)) == 0 ? std::countr_zero(static_cast<unsigned>(t.block)) : -1;
  sp.top_k = t.top_k;
  sp.cap = t.cap;
  sp.max_k_blocks = t.max_k_blocks;
  sp.rows = t.rows;
  sp.causal = t.causal;
  sp.keep_diagonal = t.keep_diagonal;
  const std::int64_t blocks = std::int64_t{t.num_groups} * t.heads;
  if (blocks > 0 && t.cap > 0) {
    arch::launch(select_kernel_for(t.held, t.pdim), dim3(static_cast<unsigned>(blocks)),
                 dim3(static_cast<unsigned>(select_threads(t.rows))),
                 static_cast<std::size_t>(t.select_shared), s, t.dependent_launch, sp);
  }
  if (a.gradients) transpose_on_device(a, s);
}

std::vector<std::int32_t> download_blocks(const topk_device_plan& t, stream_ref stream) {
  std::vector<std::int32_t> cols(t.attention->col_idx.size());
  const auto s = static_cast<cudaStream_t>(stream.handle);
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(cols.data(), t.attention->col_idx.data(),
                                     cols.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return cols;
}

}  // namespace trisparse::cuda
