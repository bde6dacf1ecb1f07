#pragma once
// Device helpers of the row-interleaved BCSR pipeline: which item and head a launch's work index
// is, the key of a position, and 16-byte row loads as floats.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/fragments.cuh"
#include "interleaved_bcsr.hpp"

namespace trisparse::cuda::interleaved {

/// The work items of a launch: a shared mask's items once per head; per-head masks, the items
/// of the launch's heads.
__device__ __forceinline__ std::int64_t items_in_launch(const params& p, const work& w) {
  if (p.mask_heads == 1) return std::int64_t{p.heads} * w.first[1];
  return w.first[p.h0 + p.heads] - w.first[p.h0];
}

struct item_at {
  std::int32_t index;  // into the work's items
  std::int32_t slot;   // the attention head, less the launch's first
};

/// Work index i (< items_in_launch) of a launch over items of type Item.
template <class Item>
__device__ __forceinline__ item_at decode(const params& p, const work& w, std::int64_t i) {
  if (p.mask_heads == 1) {
    const std::int32_t n = w.first[1];
    return {static_cast<std::int32_t>(i % n), static_cast<std::int32_t>(i / n)};
  }
  const auto index = static_cast<std::int32_t>(w.first[p.h0] + i);
  const std::int32_t row = static_cast<const Item*>(w.items)[index].row;
  return {index, p.rows[row].mask_head - p.h0};
}

/// The key (local to the sequence) at position x of block row r.
__device__ __forceinline__ std::int32_t key_at(const params& p, const block_row& r,
                                               std::int32_t x) {
  return p.col_idx[r.first + x / p.block] * p.block + x % p.block;
}

/// The last key (local) that local query row i of a sequence of lq queries and lk keys may
/// attend (causal: aligned at the bottom right).
__device__ __forceinline__ std::int64_t last_key(const params& p, std::int64_t i, std::int64_t lq,
                                                 std::int64_t lk) {
  const std::int64_t aligned = i + (lk - lq);
  return p.causal && aligned < lk - 1 ? aligned : lk - 1;
}

/// Eight elements at a 16-byte aligned src, as floats.
template <class T>
__device__ __forceinline__ void load8(const T* src, float (&f)[8]) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = frags::to_float(e[i]);
}

}  // namespace trisparse::cuda::interleaved
