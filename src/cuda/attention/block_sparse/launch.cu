// The fused block-sparse backend: plans (kernel choice, tile order) and the one dispatch point of
// run-time (kernel, tile) to an instantiation; (dtype, head dim, output dtype): dispatch.cuh.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "device_plan.cuh"
#include "dispatch.cuh"
#include "heuristics.hpp"
#include "kernel.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

namespace {

/// Query rows per tile: the largest of 64, 32, 16 that divides the block, so a tile never crosses
/// a query or key block. (128-row tiles of 8 warps measured no faster at G = 128 than two 64-row
/// tiles: docs/notes/block_sparse.md.)
std::int64_t tile_rows_for(std::int64_t block) {
  for (const std::int64_t t : {64, 32, 16})
    if (block % t == 0) return t;
  return 0;
}

// The mma.sync kernel: BM query rows, BN = BM keys per step, a warp per 16 rows. (32 rows per
// warp, each K/V fragment feeding two MMAs, spilled under the 128-register cap at D = 64 and
// measured slower without it: docs/notes/block_sparse.md.)
void launch_mma(std::int64_t bm, const block_sparse::kernel_key& key, const block_sparse::params& p,
                std::int32_t tiles, const attention_dropout& dropout, cudaStream_t s) {
  block_sparse::dispatch(key, [&]<class T, int D, class O>() {
    const auto with_tile = [&]<int BM>() {
      block_sparse::with_dropout_or_bias(
          dropout, p.block_bias != nullptr, [&]<bool DROPOUT, bool BIAS>() {
            using walk = block_sparse::tile_walk<BM, BM>;
            block_sparse::launch_kernel<
                block_sparse::block_sparse_kernel<T, D, O, BM, BM, walk, DROPOUT, BIAS>>(
                block_sparse::threads<BM>(), block_sparse::shared_bytes<D, BM, BM>(), p, tiles, s);
          });
    };
    switch (bm) {
      case 16:
        return with_tile.template operator()<16>();
      case 32:
        return with_tile.template operator()<32>();
      default:
        return with_tile.template operator()<64>();
    }
  });
}

// Whether this build holds the wgmma kernel and the current device (compute capability 9.0) runs
// it.
bool wgmma_runs_here(int device) {
#if TRISPARSE_HAVE_SM90A
  int major = 0, minor = 0;
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
#else
  (void)device;
  return false;
#endif
}

// Key blocks per (query block row, mask head), over the whole batch.
double mean_key_blocks(const block_sparse_mask& mask) {
  std::int64_t rows = 0;
  for (const block_mask& m : mask.masks) rows += m.blocks.rows;
  return rows == 0 ? 0.0 : static_cast<double>(mask.active_blocks()) / static_cast<double>(rows);
}

std::int32_t narrow(std::int64_t x, const char* what) {
  if (x > std::numeric_limits<std::int32_t>::max())
    throw invalid_input(std::string("block-sparse attention: ") + what + " exceeds 2^31 - 1");
  return static_cast<std::int32_t>(x);
}

// The tiles in launch order: most work first (stable).
std::vector<block_sparse::tile> by_work(const std::vector<block_sparse::tile>& tiles,
                                        const std::vector<std::int64_t>& work) {
  std::vector<std::size_t> order(tiles.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return work[a] > work[b]; });
  std::vector<block_sparse::tile> sorted(tiles.size());
  for (std::size_t i = 0; i < order.size(); ++i) sorted[i] = tiles[order[i]];
  return sorted;
}

// The query tiles of `rows` rows of every sequence, and their work: the key tiles of `rows` keys
// visited (the most over the mask heads).
void query_tiles(const block_sparse_mask& mask, std::int64_t rows,
                 std::vector<block_sparse::tile>& tiles, std::vector<std::int64_t>& work) {
  const std::int64_t g = mask.block;
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    const std::int64_t lq = mask.len_q(b);
    // The kernel's row and key arithmetic is 32-bit.
    narrow(std::max(lq, mask.len_k(b)) + 2 * mask.block, "a sequence length");
    for (std::int64_t r0 = 0; r0 < lq; r0 += rows) {
      const std::int64_t kmax = mask.last_key(b, std::min(lq, r0 + rows) - 1);
      std::int64_t most = 0;
      for (std::int64_t h = 0; h < mask.heads; ++h) {
        const csr_graph& blocks = mask.masks[b * mask.heads + h].blocks;
        std::int64_t n = 0;
        for (std::int64_t e = blocks.row_ptr[r0 / g]; e < blocks.row_ptr[r0 / g + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          if (j0 <= kmax) n += std::min(g, kmax + 1 - j0 + rows - 1) / rows;
        }
        most = std::max(most, n);
      }
      tiles.push_back({narrow(b, "the batch"), narrow(r0, "the sequence length")});
      work.push_back(most);
    }
  }
}

// The tiles of `rows` rows of every sequence (queries, or keys with `keys`) in the layout's order:
// sequence by sequence, for causal queries the last rows (the most keys) first. The order of
// plans whose blocks the device writes, unknown when they are built.
std::vector<block_sparse::tile> layout_tiles(const block_sparse_mask& layout, std::int64_t rows,
                                             bool keys) {
  std::vector<block_sparse::tile> tiles;
  for (std::int64_t b = 0; b < layout.batch(); ++b) {
    const std::int64_t n = keys ? layout.len_k(b) : layout.len_q(b);
    narrow(std::max(layout.len_q(b), layout.len_k(b)) + 2 * layout.block, "a sequence length");
    for (std::int64_t r0 = 0; r0 < n; r0 += rows)
      tiles.push_back({narrow(b, "the batch"), narrow(r0, "the sequence length")});
  }
  if (layout.causal && !keys) std::reverse(tiles.begin(), tiles.end());
  return tiles;
}

// Where each mask of the layout lives, with `slots` entries a block row (0: room for every key
// block) and mask (b, h)'s kept bytes at b * seq_stride + h * head_stride.
std::vector<mask_extent> extents_of(const block_sparse_mask& layout, std::int64_t slots,
                                    std::int64_t seq_stride, std::int64_t head_stride) {
  std::vector<mask_extent> extents;
  std::int64_t row0 = 0, col0 = 0, base = 0;
  const std::int64_t g = layout.block;
  for (std::int64_t b = 0; b < layout.batch(); ++b) {
    const std::int64_t rows = (layout.len_q(b) + g - 1) / g, cols = (layout.len_k(b) + g - 1) / g;
    for (std::int64_t h = 0; h < layout.heads; ++h) {
      extents.push_back({narrow(row0, "the mask rows"), narrow(col0, "the mask columns"),
                         narrow(rows, "the query blocks"), narrow(cols, "the key blocks"),
                         narrow(base, "the blocks"), b * seq_stride + h * head_stride});
      row0 += rows + 1;
      col0 += cols + 1;
      base += rows * (slots > 0 ? slots : cols);
    }
  }
  narrow(std::max({row0, col0, base}), "the blocks");
  return extents;
}

// The plan's kernel and tile rows; `mean` = key blocks per block row, < 0 where unknown (then
// automatic takes wgmma, not its two-warpgroup form).
void choose_kernel(block_sparse_device_plan& plan, std::int64_t block, block_kernel kernel,
                   double mean) {
  if (tile_rows_for(block) == 0) {
    throw not_supported("the CUDA block-sparse kernel takes blocks that are multiples of 16, not " +
                        std::to_string(block));
  }
  plan.device = current_device().device;
  const bool sm90 = wgmma_runs_here(plan.device);
  const bool pingpong = kernel == block_kernel::wgmma_pingpong;
  if (kernel == block_kernel::wgmma || pingpong) {
    const char* name = pingpong ? "block_kernel::wgmma_pingpong" : "block_kernel::wgmma";
    if (!sm90) {
      throw not_supported(std::string(name) +
                          " needs a compute capability 9.0 device and a build whose CUDA "
                          "architectures include 90");
    }
    if (block % (pingpong ? 128 : 64) != 0) {
      throw not_supported(std::string(name) + " takes blocks that are multiples of " +
                          (pingpong ? "128" : "64") + ", not " + std::to_string(block));
    }
  }
  const bool automatic = kernel == block_kernel::automatic && sm90;
  plan.pingpong =
      pingpong || (automatic && block % 128 == 0 &&
                   mean * static_cast<double>(block / 128) >= block_sparse::kPingpongFromTiles);
  plan.wgmma = plan.pingpong || kernel == block_kernel::wgmma || (automatic && block % 64 == 0);
  plan.tile_rows = plan.pingpong ? 128 : plan.wgmma ? 64 : tile_rows_for(block);
}

// The layout part of the backward of a plan whose blocks the device writes: tiles in the
// layout's order and room for the transposed masks (as many slots as col_idx).
void prepare_device_backward(block_sparse_device_plan& plan, const block_sparse_mask& layout,
                             const std::vector<mask_extent>& extents, cudaStream_t s) {
  const std::int64_t bm = tile_rows_for(layout.block);
  const std::vector<block_sparse::tile> tiles = layout_tiles(layout, bm, false),
                                        keys = layout_tiles(layout, bm, true);
  std::vector<std::int32_t> mask_col;
  std::size_t cols = 0;
  for (const mask_extent& e : extents) {
    mask_col.push_back(e.col0);
    cols = static_cast<std::size_t>(e.col0 + e.cols + 1);
  }
  plan.backward_tiles = device_buffer<block_sparse::tile>(tiles, s);
  plan.num_backward_tiles = narrow(static_cast<std::int64_t>(tiles.size()), "the query tiles");
  plan.key_tiles = device_buffer<block_sparse::tile>(keys, s);
  plan.num_key_tiles = narrow(static_cast<std::int64_t>(keys.size()), "the key tiles");
  plan.t_mask_col = device_buffer<std::int32_t>(mask_col, s);
  plan.t_ptr = device_buffer<std::int32_t>(std::max<std::size_t>(cols, 1), s);
  plan.t_idx = device_buffer<std::int32_t>(std::max<std::size_t>(plan.col_idx.size(), 1), s);
  plan.backward_tile_rows = bm;
  plan.gradients = true;
}

void set_extents(block_sparse_device_plan& plan, const std::vector<mask_extent>& extents,
                 cudaStream_t s) {
  plan.extents = device_buffer<mask_extent>(extents, s);
  plan.num_masks = narrow(static_cast<std::int64_t>(extents.size()), "the masks");
  for (const mask_extent& e : extents) {
    plan.most_rows = std::max(plan.most_rows, e.rows);
    plan.most_cols = std::max(plan.most_cols, e.cols);
  }
}

}  // namespace

bool block_sparse_supports(std::int64_t block) { return tile_rows_for(block) > 0; }

std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan_on_device(
    const block_sparse_mask& layout, const device_block_mask& kept, block_kernel kernel,
    bool gradients, double mean_blocks, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  auto plan = std::make_shared<block_sparse_device_plan>();
  choose_kernel(*plan, layout.block, kernel, mean_blocks);
  expect_current_device(kept.device_id);
  plan->block = layout.block;
  plan->mask_heads = layout.heads;
  plan->rows_q = layout.cu_seqlens_q.back();
  plan->causal = layout.causal;
  const std::vector<mask_extent> extents = extents_of(layout, 0, kept.seq_stride, kept.head_stride);
  std::vector<std::int32_t> mask_row;
  std::size_t rows = 0, slots = 0;
  for (const mask_extent& e : extents) {
    mask_row.push_back(e.row0);
    rows = static_cast<std::size_t>(e.row0 + e.rows + 1);
    slots = static_cast<std::size_t>(e.base) + static_cast<std::size_t>(e.rows) * e.cols;
  }
  const std::vector<block_sparse::tile> tiles = layout_tiles(layout, plan->tile_rows, false);
  plan->num_tiles = narrow(static_cast<std::int64_t>(tiles.size()), "the query tiles");
  plan->cu_q = device_buffer<std::int64_t>(layout.cu_seqlens_q, s);
  plan->cu_k = device_buffer<std::int64_t>(layout.cu_seqlens_k, s);
  plan->mask_row = device_buffer<std::int32_t>(mask_row, s);
  plan->row_ptr = device_buffer<std::int32_t>(std::max<std::size_t>(rows, 1), s);
  plan->col_idx = device_buffer<std::int32_t>(std::max<std::size_t>(slots, 1), s);
  plan->tiles = device_buffer<block_sparse::tile>(tiles, s);
  set_extents(*plan, extents, s);
  if (gradients) prepare_device_backward(*plan, layout, extents, s);
  plan->from_kept = true;
  plan->kept_layout = kept;
  plan->kept_layout.data = nullptr;
  fill_from_kept(*plan, device_kept{static_cast<const std::uint8_t*>(kept.data), kept.row_stride},
                 s);
  return plan;
}

void refill_block_sparse_plan(block_sparse_device_plan& plan, const device_block_mask& kept,
                              stream_ref stream, const bool* due) {
  const device_block_mask& was = plan.kept_layout;
  TRISPARSE_EXPECTS_INPUT(plan.from_kept,
                          "refill: the plan was not built from a mask on the device");
  TRISPARSE_EXPECTS_INPUT(
      kept.device_id == was.device_id && kept.seq_stride == was.seq_stride &&
          kept.head_stride == was.head_stride && kept.row_stride == was.row_stride &&
          kept.rows == was.rows && kept.cols == was.cols,
      "refill: kept must have the device, strides and block counts the plan was built with "
      "(" +
          std::to_string(was.rows) + " x " + std::to_string(was.cols) + " blocks, strides " +
          std::to_string(was.seq_stride) + ", " + std::to_string(was.head_stride) + ", " +
          std::to_string(was.row_stride) + " on device " + std::to_string(was.device_id) + ")");
  TRISPARSE_EXPECTS_INPUT(kept.data != nullptr || plan.num_masks == 0 || plan.most_rows == 0,
                          "refill: kept has null data");
  expect_current_device(kept.device_id);
  fill_from_kept(plan, device_kept{static_cast<const std::uint8_t*>(kept.data), kept.row_stride},
                 static_cast<cudaStream_t>(stream.handle), due);
}

void prepare_topk_backward(block_sparse_device_plan& plan, const block_sparse_mask& skeleton,
                           std::int64_t slots, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::vector<mask_extent> extents = extents_of(skeleton, slots, 0, 0);
  set_extents(plan, extents, s);
  prepare_device_backward(plan, skeleton, extents, s);
}

const char* kernel_name(const block_sparse_device_plan& plan) {
  if (plan.pingpong) return "wgmma, two warpgroups";
  return plan.wgmma ? "wgmma" : "mma.sync";
}

std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan(const block_sparse_mask& mask,
                                                                 block_kernel kernel,
                                                                 bool gradients,
                                                                 stream_ref /*stream*/) {
  auto plan = std::make_shared<block_sparse_device_plan>();
  choose_kernel(*plan, mask.block, kernel, mean_key_blocks(mask));
  const std::int64_t bm = plan->tile_rows;
  plan->block = mask.block;
  plan->mask_heads = mask.heads;
  plan->rows_q = mask.cu_seqlens_q.back();
  plan->causal = mask.causal;
  // Flatten the masks: row_ptr entries are offsets into the one col_idx array.
  std::vector<std::int32_t> mask_row, row_ptr, col_idx;
  for (const block_mask& m : mask.masks) {
    mask_row.push_back(narrow(static_cast<std::int64_t>(row_ptr.size()), "the mask rows"));
    const auto base = static_cast<std::int64_t>(col_idx.size());
    for (const std::int64_t e : m.blocks.row_ptr) row_ptr.push_back(narrow(base + e, "the blocks"));
    col_idx.insert(col_idx.end(), m.blocks.col_idx.begin(), m.blocks.col_idx.end());
  }
  std::vector<block_sparse::tile> tiles;
  std::vector<std::int64_t> work;
  query_tiles(mask, bm, tiles, work);
  const std::vector<block_sparse::tile> sorted = by_work(tiles, work);
  plan->num_tiles = narrow(static_cast<std::int64_t>(sorted.size()), "the query tiles");
  plan->cu_q = device_buffer<std::int64_t>(mask.cu_seqlens_q);
  plan->cu_k = device_buffer<std::int64_t>(mask.cu_seqlens_k);
  plan->mask_row = device_buffer<std::int32_t>(mask_row);
  plan->row_ptr = device_buffer<std::int32_t>(row_ptr);
  plan->col_idx = device_buffer<std::int32_t>(col_idx);
  plan->tiles = device_buffer<block_sparse::tile>(sorted);
  if (gradients) prepare_backward(*plan, mask);
  return plan;
}

void prepare_backward(block_sparse_device_plan& plan, const block_sparse_mask& mask) {
  const std::int64_t g = mask.block, bm = tile_rows_for(g);
  std::vector<block_sparse::tile> tiles;
  std::vector<std::int64_t> work;
  query_tiles(mask, bm, tiles, work);
  plan.backward_tiles = device_buffer<block_sparse::tile>(by_work(tiles, work));
  plan.num_backward_tiles = narrow(static_cast<std::int64_t>(tiles.size()), "the query tiles");
  // The transposed masks: per mask, key block c's query blocks, ascending.
  std::vector<std::int32_t> mask_col, ptr, idx;
  for (const block_mask& m : mask.masks) {
    const csr_graph& blocks = m.blocks;
    mask_col.push_back(narrow(static_cast<std::int64_t>(ptr.size()), "the mask columns"));
    std::vector<std::int64_t> count(static_cast<std::size_t>(blocks.cols) + 1, 0);
    for (const std::int32_t c : blocks.col_idx) ++count[static_cast<std::size_t>(c) + 1];
    for (std::size_t c = 1; c < count.size(); ++c) count[c] += count[c - 1];
    const auto base = static_cast<std::int64_t>(idx.size());
    for (const std::int64_t e : count) ptr.push_back(narrow(base + e, "the blocks"));
    idx.resize(idx.size() + blocks.col_idx.size());
    for (std::int64_t r = 0; r < blocks.rows; ++r)
      for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e)
        idx[static_cast<std::size_t>(base + count[static_cast<std::size_t>(blocks.col_idx[e])]++)] =
            static_cast<std::int32_t>(r);
  }
  // Key tiles, and their work: query blocks listed for the key block (the most over the heads).
  tiles.clear();
  work.clear();
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    for (std::int64_t k0 = 0; k0 < mask.len_k(b); k0 += bm) {
      std::int64_t most = 0;
      for (std::int64_t h = 0; h < mask.heads; ++h) {
        const std::size_t m = static_cast<std::size_t>(b * mask.heads + h);
        const std::int64_t at = mask_col[m] + k0 / g;
        most = std::max<std::int64_t>(
            most, ptr[static_cast<std::size_t>(at + 1)] - ptr[static_cast<std::size_t>(at)]);
      }
      tiles.push_back({narrow(b, "the batch"), narrow(k0, "the sequence length")});
      work.push_back(most);
    }
  }
  plan.key_tiles = device_buffer<block_sparse::tile>(by_work(tiles, work));
  plan.num_key_tiles = narrow(static_cast<std::int64_t>(tiles.size()), "the key tiles");
  plan.t_mask_col = device_buffer<std::int32_t>(mask_col);
  plan.t_ptr = device_buffer<std::int32_t>(ptr);
  plan.t_idx = device_buffer<std::int32_t>(idx);
  plan.backward_tile_rows = bm;
  plan.gradients = true;
}

block_sparse::params run_params(const block_sparse_device_plan& plan, const tensor_view& q,
                                const tensor_view& k, const tensor_view& v, const tensor_view& out,
                                const tensor_view& lse, double scale) {
  block_sparse::params p{};
  static_cast<ragged_attention_io&>(p) =
      ragged_io_of(q, k, v, out, plan.cu_q.data(), plan.cu_k.data());
  p.mask_row = plan.mask_row.data();
  p.row_ptr = plan.row_ptr.data();
  p.col_idx = plan.col_idx.data();
  p.tiles = plan.tiles.data();
  p.num_tiles = plan.num_tiles;
  p.heads = narrow(q.heads, "the heads");
  p.mask_heads = static_cast<std::int32_t>(plan.mask_heads);
  p.block = static_cast<std::int32_t>(plan.block);
  p.causal = plan.causal;
  p.negate_scores = scale < 0;
  p.scale_log2 = scale_log2(std::abs(scale));
  if (lse.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(
        lse.type == dtype::f32,
        "block-sparse attention writes the lse as f32, not " + std::string(to_string(lse.type)));
    p.lse = static_cast<float*>(lse.data);
    p.lse_row = lse.row_stride;
    p.lse_head = lse.head_stride;
  }
  return p;
}

void run_block_sparse(const block_sparse_device_plan& plan, const tensor_view& q,
                      const tensor_view& k, const tensor_view& v, const tensor_view& out,
                      const tensor_view& lse, double scale, const attention_dropout& dropout,
                      const block_bias_views& bias, stream_ref stream) {
  check_attention_operands(q, k, v, out, "the CUDA block-sparse kernel");
  expect_current_device(plan.device);
  block_sparse::params p = run_params(plan, q, k, v, out, lse, scale);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const block_sparse::kernel_key key{q.type, out.type, q.dim};
  block_sparse::set_dropout(p, dropout);
  block_sparse::set_block_bias(p, bias.bias, bias.qb_max);
#if TRISPARSE_HAVE_SM90A
  if (plan.wgmma)
    return block_sparse::launch_wgmma(key, p, k.rows, v.rows, plan.pingpong, plan.num_tiles,
                                      dropout, s);
#endif
  launch_mma(plan.tile_rows, key, p, plan.num_tiles, dropout, s);
}

std::int64_t device_bytes(const block_sparse_device_plan& plan) {
  return static_cast<std::int64_t>(
      plan.cu_q.bytes() + plan.cu_k.bytes() + plan.mask_row.bytes() + plan.row_ptr.bytes() +
      plan.col_idx.bytes() + plan.tiles.bytes() + plan.t_mask_col.bytes() + plan.t_ptr.bytes() +
      plan.t_idx.bytes() + plan.backward_tiles.bytes() + plan.key_tiles.bytes());
}

}  // namespace trisparse::cuda
