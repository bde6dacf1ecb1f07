#pragma once
// Which tensor-core kernel a block-sparse plan runs (block_sparse_plan_options::kernel), apart from
// the plans so that the backends' private headers take it without them.

namespace trisparse {

/// The tensor-core instructions algorithm::block (the cuda_block backend) runs on.
enum class block_kernel {
  automatic,  ///< on sm_90: wgmma_pingpong for blocks that are multiples of 128 where query
              ///< block rows keep >= 12 key tiles of 128 on average, wgmma for other
              ///< multiples of 64; mma_sync otherwise
  mma_sync,   ///< warp-level mma.sync (sm_80 and later): 16 query rows a warp
  wgmma,      ///< warpgroup wgmma (sm_90 only, blocks that are multiples of 64): 64 rows a block
  wgmma_pingpong,  ///< two wgmma warpgroups taking turns on the tensor cores, 128 rows a block,
                   ///< fed by a producer warpgroup (sm_90 only, blocks that are multiples of 128)
};

}  // namespace trisparse
