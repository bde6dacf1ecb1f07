#pragma once
// Run-time (dtype, head dim, output dtype) -> the block-sparse kernels' template arguments, and
// their launch; shared by the mma.sync (launch.cu) and wgmma (launch_sm90.cu) instantiations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <string>

#include "../../common/current_device.cuh"
#include "../../common/dependent_launch.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "params.hpp"
#include "trisparse/core/dtype.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda::block_sparse {

struct kernel_key {
  dtype in, out;
  std::int64_t dim;
};

/// Calls f.template operator()<T, D, O>() for the key's input type T (__half, __nv_bfloat16),
/// head dim D (64, 128) and output type O (float, __half, __nv_bfloat16).
/// @throws invalid_input for any other dtype or dim.
template <class F>
void dispatch(const kernel_key& key, F&& f) {
  with_half_type(key.in, "block-sparse attention's q", [&]<class T>() {
    with_head_dim<64, 128>(key.dim, "the CUDA block-sparse kernel's head_dim", [&]<int D>() {
      with_type<float, __half, __nv_bfloat16>(key.out, "block-sparse attention's out",
                                              [&]<class O>() { f.template operator()<T, D, O>(); });
    });
  });
}

/// f.template operator()<DROPOUT>() for the kernels with or without attention dropout.
template <class F>
void with_dropout(const attention_dropout& dropout, F&& f) {
  if (dropout.p > 0)
    f.template operator()<true>();
  else
    f.template operator()<false>();
}

/// f.template operator()<DROPOUT, BIAS>() for the block kernels: with attention dropout (and a
/// block bias or none: the dropout kernels read it where set, b2 = 0 otherwise, which leaves
/// their arithmetic exact), with a block bias, or neither.
template <class F>
void with_dropout_or_bias(const attention_dropout& dropout, bool biased, F&& f) {
  if (dropout.p > 0)
    f.template operator()<true, true>();
  else if (biased)
    f.template operator()<false, true>();
  else
    f.template operator()<false, false>();
}

/// As with_dropout_or_bias, with dropout without a bias apart: for the sm_90 backward, whose
/// dropout kernels spill more with the bias path (dk/dv at D 128: 104 bytes against 64; +2.4-3.8 %
/// a dropout step, docs/notes/dropout.md).
template <class F>
void with_dropout_and_bias(const attention_dropout& dropout, bool biased, F&& f) {
  if (dropout.p > 0 && !biased)
    f.template operator()<true, false>();
  else
    with_dropout_or_bias(dropout, biased, f);
}

/// Launches Kernel(p, extra...) (p: params or a derived struct) over tiles x heads blocks (its
/// shared-memory limit raised once), with p.down_wave = the blocks the device holds at once, so
/// that every other wave of blocks walks its keys in descending order; as a dependent launch where
/// the kernel was built for sm_90.
template <auto Kernel, class P, class... Extra>
void launch_kernel(int threads, int shared_bytes, const P& p, std::int32_t tiles, cudaStream_t s,
                   const Extra&... extra) {
  static const bool configured = [&] {
    TRISPARSE_CUDA_TRY(
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
    return true;
  }();
  (void)configured;
  static const int per_sm = [&] {
    int n = 0;
    TRISPARSE_CUDA_TRY(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, shared_bytes));
    return n;
  }();
  const std::int64_t blocks = std::int64_t{tiles} * p.heads;
  if (blocks == 0) return;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    throw invalid_input("block-sparse attention: too many query tiles x heads for one launch");
  // A dependent launch where the kernel waits for the grid before it (tile_walk): its blocks take
  // the SMs that a top-k selection leaves and set up while the selection ends.
  static const bool dependent = arch::waits_for_primary(Kernel);
  P with_wave = p;
  with_wave.down_wave = current_device().sms * per_sm;
  arch::launch(Kernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)),
               static_cast<std::size_t>(shared_bytes), s, dependent, with_wave, extra...);
}

/// The wgmma kernels (sm_90 only; launch_sm90.cu, built when the architectures include 90): one
/// warpgroup on 64-row tiles, or with `pingpong` two on 128-row tiles; k and v hold k_rows and
/// v_rows rows (their TMA descriptors' extents); p's dropout fields set where dropout.p > 0.
void launch_wgmma(const kernel_key& key, const params& p, std::int64_t k_rows, std::int64_t v_rows,
                  bool pingpong, std::int32_t tiles, const attention_dropout& dropout,
                  cudaStream_t s);

/// The wgmma backward (sm_90 only, launch_sm90.cu): dq over the query tiles, then dk and dv over
/// the key tiles, 64 rows a tile (the plan's backward tile), D = 64 or 128; the terms already
/// written.
void launch_wgmma_backward(dtype in, std::int64_t dim, const backward_params& p,
                           std::int32_t query_tiles, std::int32_t key_tiles,
                           const attention_dropout& dropout, cudaStream_t s);

/// The head dims the wgmma backward takes.
inline bool wgmma_backward_takes(std::int64_t dim) { return dim == 64 || dim == 128; }

}  // namespace trisparse::cuda::block_sparse
