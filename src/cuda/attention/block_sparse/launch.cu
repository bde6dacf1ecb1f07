// The fused block-sparse backend's one dispatch point: run-time (dtype, head dim, output dtype,
// tile) become the kernel's template arguments here and nowhere else.
#include <algorithm>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "kernel.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

struct block_sparse_device_plan {
  int device = 0;
  std::int64_t block = 0, tile_rows = 0, mask_heads = 1;
  bool causal = false;
  std::int32_t num_tiles = 0;
  device_buffer<std::int64_t> cu_q, cu_k;
  device_buffer<std::int32_t> mask_row, row_ptr, col_idx;
  device_buffer<block_sparse::tile> tiles;
};

namespace {

/// Query rows per tile: the largest of 64, 32, 16 that divides the block, so a tile never crosses
/// a query or key block. (128-row tiles of 8 warps measured no faster at G = 128 than two 64-row
/// tiles: docs/notes/block_sparse.md.)
std::int64_t tile_rows_for(std::int64_t block) {
  for (const std::int64_t t : {64, 32, 16})
    if (block % t == 0) return t;
  return 0;
}

// Tiles: BM query rows, BN = BM keys per step, a warp per 16 rows. (32 rows per warp, each K/V
// fragment feeding two MMAs, spilled under the 128-register cap at D = 64 and measured slower
// without it: docs/notes/block_sparse.md.)
template <class T, int D, class O, int BM>
void launch(const block_sparse::params& p, std::int32_t tiles, cudaStream_t s) {
  constexpr int BN = BM;
  constexpr int kBytes = block_sparse::shared_bytes<D, BM, BN>();
  const auto kernel = block_sparse::block_sparse_kernel<T, D, O, BM, BN>;
  static const bool configured = [&] {
    TRISPARSE_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    return true;
  }();
  (void)configured;
  const std::int64_t blocks = std::int64_t{tiles} * p.heads;
  if (blocks == 0) return;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    throw invalid_input("block-sparse attention: too many query tiles x heads for one launch");
  kernel<<<static_cast<unsigned>(blocks), block_sparse::threads<BM>(), kBytes, s>>>(p);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

template <class T, int D, class O>
void launch_tile(std::int64_t bm, const block_sparse::params& p, std::int32_t tiles,
                 cudaStream_t s) {
  switch (bm) {
    case 16:
      return launch<T, D, O, 16>(p, tiles, s);
    case 32:
      return launch<T, D, O, 32>(p, tiles, s);
    default:
      return launch<T, D, O, 64>(p, tiles, s);
  }
}

template <class T, int D>
void launch_out(dtype out, std::int64_t bm, const block_sparse::params& p, std::int32_t tiles,
                cudaStream_t s) {
  switch (out) {
    case dtype::f32:
      return launch_tile<T, D, float>(bm, p, tiles, s);
    case dtype::f16:
      return launch_tile<T, D, __half>(bm, p, tiles, s);
    case dtype::bf16:
      return launch_tile<T, D, __nv_bfloat16>(bm, p, tiles, s);
    default:
      throw invalid_input("block-sparse attention writes f32, f16 or bf16 output, not " +
                          std::string(to_string(out)));
  }
}

template <class T>
void launch_dim(std::int64_t d, dtype out, std::int64_t bm, const block_sparse::params& p,
                std::int32_t tiles, cudaStream_t s) {
  switch (d) {
    case 64:
      return launch_out<T, 64>(out, bm, p, tiles, s);
    case 128:
      return launch_out<T, 128>(out, bm, p, tiles, s);
    default:
      throw invalid_input("the CUDA block-sparse kernel supports head_dim 64 or 128, not " +
                          std::to_string(d));
  }
}

std::int32_t narrow(std::int64_t x, const char* what) {
  if (x > std::numeric_limits<std::int32_t>::max())
    throw invalid_input(std::string("block-sparse attention: ") + what + " exceeds 2^31 - 1");
  return static_cast<std::int32_t>(x);
}

}  // namespace

bool block_sparse_supports(std::int64_t block) { return tile_rows_for(block) > 0; }

std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan(const block_sparse_mask& mask,
                                                                 stream_ref /*stream*/) {
  const std::int64_t bm = tile_rows_for(mask.block);
  if (bm == 0) {
    throw not_supported("the CUDA block-sparse kernel takes blocks that are multiples of 16, not " +
                        std::to_string(mask.block));
  }
  auto plan = std::make_shared<block_sparse_device_plan>();
  plan->device = current_device().device;
  plan->block = mask.block;
  plan->tile_rows = bm;
  plan->mask_heads = mask.heads;
  plan->causal = mask.causal;
  // Flatten the masks: row_ptr entries are offsets into the one col_idx array.
  std::vector<std::int32_t> mask_row, row_ptr, col_idx;
  for (const block_mask& m : mask.masks) {
    mask_row.push_back(narrow(static_cast<std::int64_t>(row_ptr.size()), "the mask rows"));
    const auto base = static_cast<std::int64_t>(col_idx.size());
    for (const std::int64_t e : m.blocks.row_ptr) row_ptr.push_back(narrow(base + e, "the blocks"));
    col_idx.insert(col_idx.end(), m.blocks.col_idx.begin(), m.blocks.col_idx.end());
  }
  // Tiles, and their work: key tiles visited (the most over the mask heads).
  std::vector<block_sparse::tile> tiles;
  std::vector<std::int64_t> work;
  const std::int64_t g = mask.block;
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    const std::int64_t lq = mask.len_q(b);
    // The kernel's row and key arithmetic is 32-bit.
    narrow(std::max(lq, mask.len_k(b)) + 2 * mask.block, "a sequence length");
    for (std::int64_t r0 = 0; r0 < lq; r0 += bm) {
      const std::int64_t kmax = mask.last_key(b, std::min(lq, r0 + bm) - 1);
      std::int64_t most = 0;
      for (std::int64_t h = 0; h < mask.heads; ++h) {
        const csr_graph& blocks = mask.masks[b * mask.heads + h].blocks;
        std::int64_t n = 0;
        for (std::int64_t e = blocks.row_ptr[r0 / g]; e < blocks.row_ptr[r0 / g + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          if (j0 <= kmax) n += std::min(g, kmax + 1 - j0 + bm - 1) / bm;
        }
        most = std::max(most, n);
      }
      tiles.push_back({narrow(b, "the batch"), narrow(r0, "the sequence length")});
      work.push_back(most);
    }
  }
  std::vector<std::size_t> order(tiles.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return work[a] > work[b]; });
  std::vector<block_sparse::tile> sorted(tiles.size());
  for (std::size_t i = 0; i < order.size(); ++i) sorted[i] = tiles[order[i]];
  plan->num_tiles = narrow(static_cast<std::int64_t>(sorted.size()), "the query tiles");
  plan->cu_q = device_buffer<std::int64_t>(mask.cu_seqlens_q);
  plan->cu_k = device_buffer<std::int64_t>(mask.cu_seqlens_k);
  plan->mask_row = device_buffer<std::int32_t>(mask_row);
  plan->row_ptr = device_buffer<std::int32_t>(row_ptr);
  plan->col_idx = device_buffer<std::int32_t>(col_idx);
  plan->tiles = device_buffer<block_sparse::tile>(sorted);
  return plan;
}

void run_block_sparse(const block_sparse_device_plan& plan, const tensor_view& q,
                      const tensor_view& k, const tensor_view& v, const tensor_view& out,
                      double scale, stream_ref stream) {
  check_16bit_inputs(q, k, v, "the CUDA block-sparse kernel");
  if (v.dim != q.dim) {
    throw invalid_input("the CUDA block-sparse kernel needs v's dim equal to q's (" +
                        std::to_string(q.dim) + ")");
  }
  check_16byte_rows(q, "q");
  check_16byte_rows(k, "k");
  check_16byte_rows(v, "v");
  check_16byte_rows(out, "out");
  int device = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  if (device != plan.device) {
    throw invalid_input("the plan was built on device " + std::to_string(plan.device) +
                        " but device " + std::to_string(device) + " is current");
  }
  block_sparse::params p{};
  static_cast<attention_io&>(p) = attention_io_of(q, k, v, out);
  p.cu_q = plan.cu_q.data();
  p.cu_k = plan.cu_k.data();
  p.mask_row = plan.mask_row.data();
  p.row_ptr = plan.row_ptr.data();
  p.col_idx = plan.col_idx.data();
  p.tiles = plan.tiles.data();
  p.heads = narrow(q.heads, "the heads");
  p.mask_heads = static_cast<std::int32_t>(plan.mask_heads);
  p.block = static_cast<std::int32_t>(plan.block);
  p.causal = plan.causal;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (q.type == dtype::f16)
    launch_dim<__half>(q.dim, out.type, plan.tile_rows, p, plan.num_tiles, s);
  else
    launch_dim<__nv_bfloat16>(q.dim, out.type, plan.tile_rows, p, plan.num_tiles, s);
}

std::int64_t device_bytes(const block_sparse_device_plan& plan) {
  return static_cast<std::int64_t>(plan.cu_q.bytes() + plan.cu_k.bytes() + plan.mask_row.bytes() +
                                   plan.row_ptr.bytes() + plan.col_idx.bytes() +
                                   plan.tiles.bytes());
}

}  // namespace trisparse::cuda
