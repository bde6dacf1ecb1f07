#pragma once
// Block importance from the block-sparse backward (attention_options::block_mass / block_grad):
// the dk/dv kernels hold, for each (key tile, query tile) they visit, P and dS of the tile; each
// thread sums its share of the pairs (the wgmma kernels on the tensor cores, from P's and dS's
// packed fragments), and when the walk leaves a transposed entry (a kept block) each warp reduces
// its sums and writes one partial per (entry, key tile, warp). A last kernel adds a block's
// partials in a fixed order and writes the block's mass and |dS| sum: no atomics, the same bits on
// every run.
#include <type_traits>

#include "../../common/arch/mma.cuh"
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

/// One thread's sums of P and |dS| over the pairs of the entry its walk is in, and where its warp
/// writes them.
template <int BN>
struct importance_sums {
  float mass = 0.f, grad = 0.f;
  float* out = nullptr;  // the warp's partial of transposed entry 0 (null: no importance)
  int stride = 0;        // floats from one entry's partial to the next (2 x key tiles x warps)
  bool lead = false;     // the warp's lane 0, which writes

  /// Where this warp's partials go (key tile `row0` of its block, head h); `out` stays null
  /// without importance.
  __device__ __forceinline__ importance_sums(const backward_params& p, int h, int row0) {
    if (p.imp_partial == nullptr) return;
    const int tile = (row0 % p.block) / (p.block / p.imp_sub);  // the key tile in its block
    out = p.imp_partial +
          2 * (importance_slot(p, h, 0) + tile * p.imp_warps + static_cast<int>(threadIdx.x) / 32);
    stride = 2 * p.imp_sub * p.imp_warps;
    lead = threadIdx.x % 32 == 0;
  }

  /// Adds the thread's P (s) and dS (t) elements of this tile (the kernels zero the pairs past the
  /// sequence's queries and keys); `signed_sums` (params::imp_signed): dS, not |dS|.
  __device__ __forceinline__ void add(const float (&s)[BN / 8][4], const float (&t)[BN / 8][4],
                                      bool signed_sums) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mass += s[n][e];
        grad += signed_sums ? t[n][e] : fabsf(t[n][e]);
      }
    }
  }

  /// The same sums from the tile's packed A fragments of P and dS (pa, da: the wgmma kernels'),
  /// on the tensor cores: per fragment an m16n8k16 product against all-ones, whose C holds the
  /// fragment's 16 row sums in each of its eight columns (|dS|: the pairs' sign bits cleared,
  /// unless `signed_sums`). 2 x BN / 16 products and BN logic operations a tile where the additions
  /// take 2 x BN / 2 (half without `with_grad`: the mass alone); the four lanes of a quad hold the
  /// same sums (flush<true>). The values summed are those the products use (in T).
  template <class T>
  __device__ __forceinline__ void add_fragments(const std::uint32_t (&pa)[BN / 16][4],
                                                const std::uint32_t (&da)[BN / 16][4],
                                                bool with_grad, bool signed_sums) {
    constexpr std::uint32_t one = std::is_same_v<T, __half> ? 0x3C003C00u : 0x3F803F80u;
    float cm[4] = {0.f, 0.f, 0.f, 0.f}, cg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) arch::mma_16x8x16_f32<T>(cm, pa[kp], {one, one});
    mass += cm[0] + cm[2];
    if (!with_grad) return;
    const std::uint32_t magnitude = signed_sums ? 0xFFFFFFFFu : 0x7FFF7FFFu;
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) {
      const std::uint32_t a[4] = {da[kp][0] & magnitude, da[kp][1] & magnitude,
                                  da[kp][2] & magnitude, da[kp][3] & magnitude};
      arch::mma_16x8x16_f32<T>(cg, a, {one, one});
    }
    grad += cg[0] + cg[2];
  }

  /// Writes the warp's sums as its partial of transposed entry `entry` and restarts at zero: lane
  /// sums by shuffles, no barrier (the last kernel adds the warps in order). `Quads`: the sums of
  /// add_fragments, alike in a quad's four lanes (the groups' sums only); without `with_grad`
  /// the |dS| sum is not reduced (it is not read).
  template <bool Quads = false>
  __device__ __forceinline__ void flush(int entry, bool with_grad = true) {
    if (with_grad) {
#pragma unroll
      for (int o = 16; o >= (Quads ? 4 : 1); o /= 2) {
        mass += __shfl_xor_sync(0xffffffffu, mass, o);
        grad += __shfl_xor_sync(0xffffffffu, grad, o);
      }
    } else {
#pragma unroll
      for (int o = 16; o >= (Quads ? 4 : 1); o /= 2) mass += __shfl_xor_sync(0xffffffffu, mass, o);
    }
    if (lead)
      *reinterpret_cast<float2*>(out + static_cast<std::int64_t>(entry) * stride) =
          make_float2(mass, grad);
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
