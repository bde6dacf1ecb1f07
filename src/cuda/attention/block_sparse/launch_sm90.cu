// The wgmma kernel's instantiations, compiled for sm_90a alone.
#include "dispatch.cuh"
#include "kernel_sm90.cuh"

namespace trisparse::cuda::block_sparse {

void launch_wgmma(const kernel_key& key, const params& p, std::int32_t tiles, cudaStream_t s) {
  dispatch(key, [&]<class T, int D, class O>() {
    launch_kernel<sm90::block_sparse_wgmma_kernel<T, D, O>>(sm90::kThreads, sm90::shared_bytes<D>(),
                                                            p, tiles, s);
  });
}

}  // namespace trisparse::cuda::block_sparse
