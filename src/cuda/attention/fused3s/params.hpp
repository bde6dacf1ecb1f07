#pragma once
// Host <-> kernel parameters of the fused 3S kernel (plain data, no CUDA headers).
#include <cstdint>

#include "../../common/attention_io.hpp"

#include "../../common/work_item.hpp"

namespace trisparse::cuda::fused3s {

using cuda::split_window;
using cuda::work_item;  // blocks are TCBs here

struct params : attention_io {
  std::int64_t rows;            // query rows
  const std::int64_t* row_map;  // [rows]: the query row of each window slot (nullptr: identity)
  const std::int32_t* col_idx;  // [tcbs * 8], -1 = padding
  const std::uint64_t* bitmap;  // [tcbs * 2]
  const work_item* items;
  std::int32_t num_items;
  std::int32_t team_items;  // items [0, team_items) run on all warps of a block (a team)
  const split_window* splits;
  std::int32_t num_splits;
  float scale_log2;           // scale * log2(e)
  float* part_o;              // [parts, heads, 16, D]
  float* part_ml;             // [parts, heads, 16, 2]
  std::int32_t* split_count;  // [splits, heads]: partials done, reset by the merger
  std::int32_t heads;
  // [3]: warp tasks claimed, warps done, team tasks claimed past the first per block; zero
  // between launches.
  std::uint64_t* queue;
  bool use_queue;  // false: a block per team task and a warp per other task, no claims
  // Task order: false, a window's heads side by side (task = item * heads + head); true, every
  // item of a head before the next head's (team tasks and warp tasks each), so that the K and V
  // rows gathered at a time are one head's.
  bool heads_outer;
  // Optional per-row log-sum-exp of the scaled scores (natural log, -inf for empty rows), what
  // the backward needs: nullptr = not written.
  float* lse;
  std::int64_t lse_row, lse_head;  // element strides
  // Optional per-entry score bias (natural units) of the pattern's entry e at head h:
  // bias[e * bias_row + h * bias_head] (bias_head = 0: shared by the heads); the kernel finds a
  // TCB's entries through its slots (../../formats/bsb_slots.cuh). nullptr = none.
  const float* bias;
  std::int64_t bias_row, bias_head;
  const std::int32_t* first_slot;  // [tcbs]: each TCB's first slot
  const std::int32_t* slot_entry;  // [nnz]: the pattern's entry at each slot
};

}  // namespace trisparse::cuda::fused3s
