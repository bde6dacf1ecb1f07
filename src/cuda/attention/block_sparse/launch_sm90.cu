// The wgmma kernel's instantiations, compiled for sm_90a alone, and K's and V's TMA descriptors.
#include <cudaTypedefs.h>

#include "backward_sm90.cuh"
#include "dispatch.cuh"
#include "heuristics.hpp"
#include "kernel_sm90.cuh"

namespace trisparse::cuda::block_sparse {
namespace {

/// The driver's cuTensorMapEncodeTiled (through the runtime: no link against libcuda), or null
/// where the driver does not provide it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000{};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

/// The descriptor of a [rows, heads, dim] 16-bit tensor with element strides (row, head), boxes
/// of `keys` rows x 1 head x 64 dims, 128-byte swizzle; false where the driver refuses it (the
/// kernel then copies every tile with cp.async).
bool encode_kv(CUtensorMap& map, const void* data, std::int64_t rows, std::int64_t heads,
               std::int64_t dim, std::int64_t row, std::int64_t head, int keys) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || rows == 0) return false;
  if (heads == 1) head = row;  // any valid stride: the head coordinate is always 0
  const cuuint64_t extent[3] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                                static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head) * 2,
                                 static_cast<cuuint64_t>(row) * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(keys)}, unit[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(data), extent, strides,
                box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

void launch_wgmma(const kernel_key& key, const params& p, std::int64_t k_rows, std::int64_t v_rows,
                  bool pingpong, std::int32_t tiles, const attention_dropout& dropout,
                  cudaStream_t s) {
  // 128-key steps in the two-warpgroup kernel at D = 64, where the blocks allow them (at D = 128
  // its stages would overflow shared memory). The one-warpgroup kernel takes 64-key steps: at
  // D = 64 they fit four blocks an SM (Q read from shared memory), which measured 2-12% faster at
  // G = 128 than 128-key steps at two blocks (docs/notes/block_sparse.md).
  const int keys = pingpong && key.dim == 64 && p.block % 128 == 0 ? 128 : 64;
  sm90::tma_maps maps{};
  maps.use = encode_kv(maps.k, p.k, k_rows, p.heads, key.dim, p.k_row, p.k_head, keys) &&
             encode_kv(maps.v, p.v, v_rows, p.heads, key.dim, p.v_row, p.v_head, keys);
  dispatch(key, [&]<class T, int D, class O>() {
    with_dropout_or_bias(dropout, p.block_bias != nullptr, [&]<bool DROPOUT, bool BIAS>() {
      const auto two_groups = [&]<int BN>() {
        launch_kernel<sm90::block_sparse_pingpong_kernel<T, D, O, BN, DROPOUT, BIAS>>(
            sm90::pingpong::kBlockThreads, sm90::pingpong::shared_bytes<D, BN>(), p, tiles, s,
            maps);
      };
      if constexpr (D == 64) {
        if (keys == 128) return two_groups.template operator()<128>();
      }
      if (pingpong) return two_groups.template operator()<64>();
      launch_kernel<sm90::block_sparse_wgmma_kernel<T, D, O, 64, DROPOUT, BIAS>>(
          sm90::kThreads, sm90::shared_bytes<D, 64>(), p, tiles, s, maps);
    });
  });
}

void launch_wgmma_backward(dtype in, std::int64_t dim, const backward_params& p,
                           std::int32_t query_tiles, std::int32_t key_tiles,
                           const attention_dropout& dropout, cudaStream_t s) {
  with_half_type(in, "block-sparse backward's q", [&]<class T>() {
    with_head_dim<64, 128>(dim, "the wgmma block-sparse backward's head_dim", [&]<int D>() {
      with_dropout_and_bias(dropout, p.block_bias != nullptr, [&]<bool DROPOUT, bool BIAS>() {
        launch_kernel<sm90::backward_wgmma_kernel<T, D, false, DROPOUT, 2, BIAS>>(
            128, sm90::backward_shared_bytes<D, false>(), p, query_tiles, s);
        constexpr int kBlocks = D == 128  ? kKeyPassBlocksD128
                                : DROPOUT ? kKeyPassBlocksDropout
                                          : kKeyPassBlocks;
        launch_kernel<sm90::backward_wgmma_kernel<T, D, true, DROPOUT, kBlocks, BIAS>>(
            128, sm90::backward_shared_bytes<D, true>(), p, key_tiles, s);
      });
    });
  });
}

}  // namespace trisparse::cuda::block_sparse
