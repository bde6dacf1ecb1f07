#pragma once
// Block importance from the block-sparse backward (attention_options::block_mass / block_grad):
// the dk/dv kernels hold, for each (key tile, query tile) they visit, P and dS of the tile; each
// thread sums its share of the pairs, and when the walk leaves a transposed entry (a kept block)
// each warp reduces its sums and writes one partial per (entry, key tile, warp). A last kernel adds
// a block's partials in a fixed order and writes the block's mass and |dS| sum: no atomics, the
// same bits on every run.
#include "params.hpp"

namespace trisparse::cuda::block_sparse {

/// The transposed entry a key walk is in (-1 for the query walks, which have none).
template <class Walk>
__device__ __forceinline__ int walk_entry(const Walk& w) {
  if constexpr (requires { w.entry; })
    return w.entry;
  else
    return -1;
}

/// The first partial slot of kept block `entry` (a transposed entry) for head h: its imp_sub key
/// tiles' imp_warps warps follow (params.hpp has the layout).
__device__ __forceinline__ std::int64_t importance_slot(const backward_params& p, int h,
                                                        int entry) {
  return ((p.mask_heads == 1 ? std::int64_t{h} : 0) * p.imp_slots + entry) * p.imp_sub *
         p.imp_warps;
}

/// One thread's sums of P and |dS| over the pairs of the entry its walk is in.
template <int BN>
struct importance_sums {
  float mass = 0.f, grad = 0.f;

  /// Adds the thread's P (s) and dS (t) elements of this tile (the kernels zero the pairs past the
  /// sequence's queries and keys).
  __device__ __forceinline__ void add(const float (&s)[BN / 8][4], const float (&t)[BN / 8][4]) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mass += s[n][e];
        grad += fabsf(t[n][e]);
      }
    }
  }

  /// Writes the warp's sums as its partial of (entry, this key tile) and restarts at zero: lane
  /// sums by shuffles, no barrier (the last kernel adds the warps in order).
  __device__ __forceinline__ void flush(const backward_params& p, int h, int entry, int row0) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      mass += __shfl_xor_sync(0xffffffffu, mass, o);
      grad += __shfl_xor_sync(0xffffffffu, grad, o);
    }
    if (threadIdx.x % 32 == 0) {
      const int tile = (row0 % p.block) / (p.block / p.imp_sub);  // the key tile in its block
      const std::int64_t slot =
          importance_slot(p, h, entry) + tile * p.imp_warps + static_cast<int>(threadIdx.x) / 32;
      p.imp_partial[2 * slot] = mass;
      p.imp_partial[2 * slot + 1] = grad;
    }
    mass = grad = 0.f;
  }
};

/// What the finishing kernel writes: mass[(seq * qb_max + r) * row + h * head + c] for sequence
/// seq's kept block (r, c) and head h (grad alike).
struct importance_out {
  float* mass;
  float* grad;
  std::int64_t mass_row, mass_head, grad_row, grad_head;
  std::int64_t qb_max;
};

}  // namespace trisparse::cuda::block_sparse
