#pragma once
// Fused 3S over BSB: SDDMM (mma m16n8k16), bitmap mask, online softmax (fp32, exp2), SpMM
// (mma m16n8k8) in one kernel. A warp processes one work item at a time = a row window (16 query
// rows) and a range of its 16x8 tensor-core blocks (TCBs), for one head; a window with many TCBs is
// split into several items whose partial (max, sum, O) states the last of them merges. Where warp
// slots would idle, the largest items run on all 4 warps of a block (a team), their states combined
// in shared memory. Warps are persistent and claim items from a queue, largest first.
//
// Register remapping (the paper's permuted loads, our derivation): the contraction index of Q·Kᵀ is
// permuted the same way in Q and K (it depends on the lane's t = lane%4 only), lane t holding the
// 8-element runs [i·32 + 8t, +8) of its Q rows (g, g+8; g = lane/4) and of K row col[g]
// (load_quarter). The output column index of P·V is permuted so that lane g holds the runs
// [i·64 + 8g, +8) of V rows col[2t], col[2t+1] (load_slice) and O's accumulators for the runs of
// columns 2t and 2t+1 (store_slice). Every 16-byte load of the warp covers whole 32-byte sectors,
// and fragments come straight from the loaded words. P goes from the S accumulators to the A
// fragment of P·V in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/arch/mma.cuh"
#include "../../common/convert.cuh"
#include "../../common/fragment_io.cuh"
#include "../../common/online_softmax.cuh"
#include "../../formats/bsb_slots.cuh"
#include "params.hpp"

namespace trisparse::cuda::fused3s {

__device__ __forceinline__ tcb_meta load_meta(const params& p, std::int64_t tcb, int g, int t) {
  return load_tcb_meta(p.col_idx, p.bitmap, tcb, g, t);
}

/// A lane's rows of one TCB: its K quarter-row and its two V slices.
template <int D>
struct tcb_rows {
  std::uint32_t k[D / 8];    // K[col[g]], load_quarter: D/4 halves
  std::uint32_t v0[D / 16];  // V[col[2t]], load_slice: D/8 halves
  std::uint32_t v1[D / 16];  // V[col[2t+1]]
};

template <class T, int D>
__device__ __forceinline__ void load_rows(const params& p, const tcb_meta& m, int h, int g, int t,
                                          tcb_rows<D>& r) {
  const T* k = static_cast<const T*>(p.k) + h * p.k_head;
  const T* v = static_cast<const T*>(p.v) + h * p.v_head;
  // Padding slots (-1) load zeros: their P is 0, and 0 * garbage could be NaN.
  load_quarter<D>(m.cb >= 0 ? k + m.cb * p.k_row : nullptr, t, r.k);
  load_slice<D>(m.c0 >= 0 ? v + m.c0 * p.v_row : nullptr, g, r.v0);
  load_slice<D>(m.c1 >= 0 ? v + m.c1 * p.v_row : nullptr, g, r.v1);
}

/// With a score bias: the pattern's entries of a lane's four bits of a TCB (-1 where clear), then
/// their bias in base 2 (0 where clear), a stage later (the bias loads wait on the entries).
struct tcb_bias {
  std::int32_t entry[4];
  float b[4];
};

__device__ __forceinline__ void load_entries(const params& p, const tcb_meta& m, int bit,
                                             std::int32_t first, tcb_bias& r) {
  std::int32_t slot[4];
  lane_slots(m, bit, first, slot);
#pragma unroll
  for (int i = 0; i < 4; ++i) r.entry[i] = slot[i] >= 0 ? __ldg(p.slot_entry + slot[i]) : -1;
}

__device__ __forceinline__ void load_bias(const params& p, int h, tcb_bias& r) {
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    r.b[i] =
        r.entry[i] >= 0 ? __ldg(p.bias + r.entry[i] * p.bias_row + h * p.bias_head) * kLog2e : 0.0f;
}

/// The query row (of Q and O) that window slot `slot` holds: the plan's row order, or itself.
__device__ __forceinline__ std::int64_t source_row(const params& p, std::int64_t slot) {
  return p.row_map != nullptr ? __ldg(p.row_map + slot) : slot;
}

/// Combines the partial states of a split window (run by the window's last warp): for each row,
/// m = max m_i, l = sum l_i 2^(m_i - m), O = sum O_i 2^(m_i - m) / l. Lane r < 16 owns row r's
/// (m, l); each lane owns columns lane + 32c and, per part, issues 8 rows x D/32 independent
/// coalesced loads (through L2, __ldcg: other SMs wrote the partials).
template <int D, class O, bool kLse>
__device__ __forceinline__ void merge_window(const params& p, const split_window& sw, int h,
                                             int lane) {
  constexpr int kC = D / 32;
  const auto part_base = [&](int i) { return std::int64_t{sw.first_part + i} * p.heads + h; };
  float m = kNegInf, l = 0.0f;
  if (lane < 16) {
    for (int i = 0; i < sw.parts; ++i)
      m = fmaxf(m, __ldcg(p.part_ml + part_base(i) * 32 + 2 * lane));
  }
  const float u = safe_max(m);
  if (lane < 16) {
    for (int i = 0; i < sw.parts; ++i) {
      const float* ml = p.part_ml + part_base(i) * 32 + 2 * lane;
      l += exp2f(__ldcg(ml) - u) * __ldcg(ml + 1);
    }
    const std::int64_t slot = std::int64_t{sw.window} * 16 + lane;
    if constexpr (kLse) {
      if (slot < p.rows)
        p.lse[source_row(p, slot) * p.lse_row + h * p.lse_head] = natural_lse(u, l);
    }
  }
  O* out = static_cast<O*>(p.out) + h * p.o_head;
#pragma unroll
  for (int r0 = 0; r0 < 16; r0 += 8) {
    float ur[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) ur[r] = __shfl_sync(0xffffffffu, u, r0 + r);
    float acc[8][kC] = {};
    for (int i = 0; i < sw.parts; ++i) {
      const float* po = p.part_o + part_base(i) * 16 * D + r0 * D + lane;
      const float* ml = p.part_ml + part_base(i) * 32 + 2 * r0;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float w = exp2f(__ldcg(ml + 2 * r) - ur[r]);
#pragma unroll
        for (int c = 0; c < kC; ++c) acc[r][c] += w * __ldcg(po + r * D + 32 * c);
      }
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const float lr = __shfl_sync(0xffffffffu, l, r0 + r);
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
      const std::int64_t slot = std::int64_t{sw.window} * 16 + r0 + r;
      if (slot >= p.rows) continue;
      const std::int64_t row = source_row(p, slot);
#pragma unroll
      for (int c = 0; c < kC; ++c)
        out[row * p.o_row + lane + 32 * c] = from_float<O>(acc[r][c] * inv);
    }
  }
}

/// Words of shared memory a team of `warps` needs to combine its states: per warp but the first,
/// O's accumulators and (m, l) of both rows, in fragment order (word (i, lane): conflict-free).
template <int D>
constexpr int team_words(int warps) {
  return (warps - 1) * (D / 8 * 4 + 4) * 32;
}

/// One work item (a window's TCB range) of head h, by one warp (team = 1) or by the `team` warps
/// of a thread block (member = the warp's rank): member w takes the w-th of `team` consecutive
/// shares of the item's TCBs, and the others hand their (m, l, O) to member 0 through `shared`
/// (team_words<D>(team) floats), which combines them and finishes the item.
/// kPipelined: the next TCB's rows load during this one's products (a second copy of the rows in
/// registers), else at the top of their own iteration. kBias: the scores take p.bias, each TCB's
/// first slot loaded two TCBs ahead with its metadata, the entries with the rows, the bias after
/// the products of the TCB before (at the top where not pipelined).
template <class T, int D, class O, bool kPipelined, bool kLse, bool kBias>
__device__ __forceinline__ void process_item(const params& p, const work_item& it, int h, int lane,
                                             int member, int team, float* shared) {
  constexpr int kQ = D / 4;  // halves of a Q/K row per lane
  constexpr int kV = D / 8;  // halves of a V row per lane = output columns per run
  const int g = lane / 4, t = lane % 4;
  // Window rows g and g + 8; past the last row: -1 (nothing read or written).
  const std::int64_t slot0 = std::int64_t{it.window} * 16 + g, slot1 = slot0 + 8;
  const std::int64_t row0 = slot0 < p.rows ? source_row(p, slot0) : -1,
                     row1 = slot1 < p.rows ? source_row(p, slot1) : -1;

  // Q rows g and g+8 (zeros past the last row: no read past the end).
  std::uint32_t q0[kQ / 2], q1[kQ / 2];
  const T* q = static_cast<const T*>(p.q) + h * p.q_head;
  load_quarter<D>(row0 >= 0 ? q + row0 * p.q_row : nullptr, t, q0);
  load_quarter<D>(row1 >= 0 ? q + row1 * p.q_row : nullptr, t, q1);

  float o[kV][4];
#pragma unroll
  for (int j = 0; j < kV; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.0f, l1 = 0.0f;
  const int bit = g * 8 + 2 * t;

  // Pipeline: indices two TCBs ahead, rows one TCB ahead where kPipelined.
  // A team member's share: the member-th of `team` consecutive near-equal ranges.
  const std::int32_t size = it.end - it.begin;
  const std::int32_t begin = it.begin + size * member / team,
                     end = it.begin + size * (member + 1) / team;
  tcb_meta meta1 = begin < end ? load_meta(p, begin, g, t) : tcb_meta{};
  tcb_meta meta2 = begin + 1 < end ? load_meta(p, begin + 1, g, t) : tcb_meta{};
  std::int32_t first1 = 0, first2 = 0;  // the first slots of meta1's and meta2's TCBs (kBias)
  if constexpr (kBias) {
    if (begin < end) first1 = __ldg(p.first_slot + begin);
    if (begin + 1 < end) first2 = __ldg(p.first_slot + begin + 1);
  }
  tcb_rows<D> next;
  tcb_bias next_bias;
  if (kPipelined && begin < end) {
    load_rows<T, D>(p, meta1, h, g, t, next);
    if constexpr (kBias) {
      load_entries(p, meta1, bit, first1, next_bias);
      load_bias(p, h, next_bias);
    }
  }
  for (std::int32_t tcb = begin; tcb < end; ++tcb) {
    tcb_rows<D> cur;
    tcb_bias cur_bias;
    const tcb_meta m = meta1;
    const std::int32_t first = first1;
    meta1 = meta2;
    first1 = first2;
    if (tcb + 2 < end) {
      meta2 = load_meta(p, tcb + 2, g, t);
      if constexpr (kBias) first2 = __ldg(p.first_slot + tcb + 2);
    }
    if constexpr (kPipelined) {
      cur = next;
      if constexpr (kBias) cur_bias = next_bias;
      if (tcb + 1 < end) {
        load_rows<T, D>(p, meta1, h, g, t, next);  // in flight during compute
        if constexpr (kBias) load_entries(p, meta1, bit, first1, next_bias);
      }
    } else {
      load_rows<T, D>(p, m, h, g, t, cur);
      if constexpr (kBias) {
        load_entries(p, m, bit, first, cur_bias);
        load_bias(p, h, cur_bias);
      }
    }

    // S = Q · K_tcbᵀ (16 x 8), fp32, in two independent accumulation chains (even and odd k-steps)
    // so that the dependent mma latency on the critical path halves.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int st = 0; st < D / 16; ++st) {
      const std::uint32_t a[4] = {q0[2 * st], q1[2 * st], q0[2 * st + 1], q1[2 * st + 1]};
      const std::uint32_t b[2] = {cur.k[2 * st], cur.k[2 * st + 1]};
      arch::mma_16x8x16_f32<T>(st % 2 == 0 ? s : s_odd, a, b);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += s_odd[i];
    // Bitmap mask (a score of exactly 0 is still an edge), scale folded with log2 e.
    if constexpr (kBias) {
      s[0] = (m.mask0 >> bit) & 1 ? fmaf(s[0], p.scale_log2, cur_bias.b[0]) : kNegInf;
      s[1] = (m.mask0 >> (bit + 1)) & 1 ? fmaf(s[1], p.scale_log2, cur_bias.b[1]) : kNegInf;
      s[2] = (m.mask1 >> bit) & 1 ? fmaf(s[2], p.scale_log2, cur_bias.b[2]) : kNegInf;
      s[3] = (m.mask1 >> (bit + 1)) & 1 ? fmaf(s[3], p.scale_log2, cur_bias.b[3]) : kNegInf;
    } else {
      s[0] = (m.mask0 >> bit) & 1 ? s[0] * p.scale_log2 : kNegInf;
      s[1] = (m.mask0 >> (bit + 1)) & 1 ? s[1] * p.scale_log2 : kNegInf;
      s[2] = (m.mask1 >> bit) & 1 ? s[2] * p.scale_log2 : kNegInf;
      s[3] = (m.mask1 >> (bit + 1)) & 1 ? s[3] * p.scale_log2 : kNegInf;
    }
    float x0 = fmaxf(s[0], s[1]), x1 = fmaxf(s[2], s[3]);
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float u0 = safe_max(n0), u1 = safe_max(n1);
    const float c0 = exp2f(m0 - u0), c1 = exp2f(m1 - u1);
    m0 = n0;
    m1 = n1;
    const float p0 = exp2f(s[0] - u0), p1 = exp2f(s[1] - u0), p2 = exp2f(s[2] - u1),
                p3 = exp2f(s[3] - u1);
    l0 = l0 * c0 + p0 + p1;
    l1 = l1 * c1 + p2 + p3;
    const std::uint32_t pa[2] = {arch::pack2<T>(p0, p1), arch::pack2<T>(p2, p3)};
    // O = O · diag(c) + P · V_tcb, one m16n8k8 per 8 output columns; the rescale written inside
    // the mma loop, not by scale_rows() before it: that order measured 1% slower on rmat18.
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c0;
      o[j][2] *= c1;
      o[j][3] *= c1;
      const std::uint32_t b = j % 2 == 0 ? arch::interleave_lo(cur.v0[j / 2], cur.v1[j / 2])
                                         : arch::interleave_hi(cur.v0[j / 2], cur.v1[j / 2]);
      arch::mma_16x8x8_f32<T>(o[j], pa, b);
    }
    // The next TCB's bias: its entries arrived during these products.
    if constexpr (kPipelined && kBias) {
      if (tcb + 1 < end) load_bias(p, h, next_bias);
    }
  }
  if (team > 1) {
    // Members 1.. hand their states over; member 0 rescales each to the common row maxima:
    // O = sum_w O_w 2^(m_w - m), l = sum_w l_w 2^(m_w - m), m = max_w m_w (rows g, g + 8).
    constexpr int kWords = kV * 4 + 4;
    if (member > 0) {
      float* mine = shared + (member - 1) * kWords * 32 + lane;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) mine[(4 * j + i) * 32] = o[j][i];
      }
      mine[(4 * kV) * 32] = m0;
      mine[(4 * kV + 1) * 32] = m1;
      mine[(4 * kV + 2) * 32] = l0;
      mine[(4 * kV + 3) * 32] = l1;
    }
    __syncthreads();
    if (member > 0) return;
    float n0 = m0, n1 = m1;
    for (int w = 1; w < team; ++w) {
      n0 = fmaxf(n0, shared[((w - 1) * kWords + 4 * kV) * 32 + lane]);
      n1 = fmaxf(n1, shared[((w - 1) * kWords + 4 * kV + 1) * 32 + lane]);
    }
    const float u0 = safe_max(n0), u1 = safe_max(n1);
    float c0 = exp2f(m0 - u0), c1 = exp2f(m1 - u1);
    l0 *= c0;
    l1 *= c1;
    scale_rows(o, c0, c1);
    for (int w = 1; w < team; ++w) {
      const float* theirs = shared + (w - 1) * kWords * 32 + lane;
      c0 = exp2f(theirs[(4 * kV) * 32] - u0);
      c1 = exp2f(theirs[(4 * kV + 1) * 32] - u1);
      l0 += theirs[(4 * kV + 2) * 32] * c0;
      l1 += theirs[(4 * kV + 3) * 32] * c1;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        o[j][0] += theirs[(4 * j) * 32] * c0;
        o[j][1] += theirs[(4 * j + 1) * 32] * c0;
        o[j][2] += theirs[(4 * j + 2) * 32] * c1;
        o[j][3] += theirs[(4 * j + 3) * 32] * c1;
      }
    }
    m0 = n0;
    m1 = n1;
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

  float r00[kV], r01[kV], r10[kV], r11[kV];  // rows (g, g+8) x column runs (2t, 2t+1)
  if (it.part < 0) {
    // The rows' log-sum-exp if asked for, taken now so that m and l need not stay live.
    float lse0 = 0.0f, lse1 = 0.0f;
    if constexpr (kLse) {
      lse0 = natural_lse(safe_max(m0), l0);
      lse1 = natural_lse(safe_max(m1), l1);
    }
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f,
                i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;  // empty row: 0
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      r00[j] = o[j][0] * i0;
      r01[j] = o[j][1] * i0;
      r10[j] = o[j][2] * i1;
      r11[j] = o[j][3] * i1;
    }
    O* out = static_cast<O*>(p.out) + h * p.o_head;
    if (row0 >= 0) {
      store_slice<O, D>(out + row0 * p.o_row, 2 * t, r00);
      store_slice<O, D>(out + row0 * p.o_row, 2 * t + 1, r01);
    }
    if (row1 >= 0) {
      store_slice<O, D>(out + row1 * p.o_row, 2 * t, r10);
      store_slice<O, D>(out + row1 * p.o_row, 2 * t + 1, r11);
    }
    if (kLse && t == 0) {
      if (row0 >= 0) p.lse[row0 * p.lse_row + h * p.lse_head] = lse0;
      if (row1 >= 0) p.lse[row1 * p.lse_row + h * p.lse_head] = lse1;
    }
  } else {
    // Unnormalised partial state, O [16, D] in natural column order and (m, l) per row; the last
    // warp of the window to finish merges all of them (no second launch).
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      r00[j] = o[j][0];
      r01[j] = o[j][1];
      r10[j] = o[j][2];
      r11[j] = o[j][3];
    }
    float* po = p.part_o + (std::int64_t{it.part} * p.heads + h) * 16 * D;
    store_slice<float, D>(po + g * D, 2 * t, r00);
    store_slice<float, D>(po + g * D, 2 * t + 1, r01);
    store_slice<float, D>(po + (g + 8) * D, 2 * t, r10);
    store_slice<float, D>(po + (g + 8) * D, 2 * t + 1, r11);
    if (t == 0) {
      float* pml = p.part_ml + (std::int64_t{it.part} * p.heads + h) * 32;
      pml[2 * g] = m0;
      pml[2 * g + 1] = l0;
      pml[2 * (g + 8)] = m1;
      pml[2 * (g + 8) + 1] = l1;
    }
    __threadfence();  // partials visible device-wide before the count says so
    __syncwarp();
    int* count = p.split_count + std::int64_t{it.split} * p.heads + h;
    const split_window sw = p.splits[it.split];
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(count, 1);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived == sw.parts - 1) {
      __threadfence();
      merge_window<D, O, kLse>(p, sw, h, lane);
      if (lane == 0) *count = 0;  // ready for the next launch (stream-ordered)
    }
  }
}

/// The item and head of `task` in the order p.heads_outer chooses (params.hpp).
__device__ __forceinline__ int task_head(const params& p, std::int64_t task, std::int64_t& item) {
  if (!p.heads_outer) {
    item = task / p.heads;
    return static_cast<int>(task % p.heads);
  }
  const std::int64_t team_tasks = std::int64_t{p.team_items} * p.heads;
  if (task < team_tasks) {
    item = task % p.team_items;
    return static_cast<int>(task / p.team_items);
  }
  const std::int64_t rest = task - team_tasks, others = p.num_items - p.team_items;
  item = p.team_items + rest % others;
  return static_cast<int>(rest / others);
}

/// Persistent warps: tasks (item, head) as task_head orders them, largest items first. The
/// first team_items * heads tasks run on whole blocks (teams): a block takes team task = its index
/// first, then the next unclaimed one (queue[2]), until none is left. Then each warp takes the next
/// unclaimed warp task (queue[0]) -- the first by its global index when there are no teams -- so
/// warps that finish early keep working (no idle slots while one block's slowest warp finishes, no
/// wave quantisation). The last warp to leave resets the queue for the next launch.
/// Without the queue (use_queue false) the grid has one block per team task, then one warp per
/// warp task. Dynamic shared memory: team_words<D>(kWarps) floats when team_items > 0.
/// kLse: also write each row's log-sum-exp (p.lse); an instantiation of its own, so that runs
/// that do not ask for it run the same code as before it existed.
template <class T, int D, class O, int kWarps, int kMinBlocks, bool kLse, bool kBias>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) fused3s_kernel(const params p) {
  extern __shared__ float team_state[];
  __shared__ unsigned long long claimed;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarps;
  const std::int64_t tasks = std::int64_t{p.num_items} * p.heads;
  const std::int64_t team_tasks = std::int64_t{p.team_items} * p.heads;
  const auto claim = [&] {
    unsigned long long c = 0;
    if (lane == 0) c = atomicAdd(reinterpret_cast<unsigned long long*>(p.queue), 1ull);
    return static_cast<std::int64_t>(__shfl_sync(0xffffffffu, c, 0));
  };
  // Warp tasks past the first: with teams, blocks leave the team phase at different times, so
  // every warp task is claimed; without, each warp's first is its global index.
  const std::int64_t first_claim = team_tasks > 0 ? team_tasks : warps;
  bool on_team = blockIdx.x < team_tasks;  // the same for the whole block
  std::int64_t task = blockIdx.x;
  if (!on_team) {
    task = !p.use_queue     ? team_tasks + (blockIdx.x - team_tasks) * kWarps + warp
           : team_tasks > 0 ? first_claim + claim()
                            : std::int64_t{blockIdx.x} * kWarps + warp;
  }
  // One call site: the kernel holds one copy of the item loop (two cost registers and spills).
  while (task < tasks) {
    // Rows one TCB ahead up to D = 128 at 8 warps per SM; at D = 256, or D = 128 with 12 warps
    // (168 registers), the second copy of the rows does not fit.
    constexpr bool kPipelined = D <= 64 || (D <= 128 && kMinBlocks * kWarps <= 8);
    std::int64_t item = 0;
    const int head = task_head(p, task, item);
    process_item<T, D, O, kPipelined, kLse, kBias>(p, p.items[item], head, lane, on_team ? warp : 0,
                                                   on_team ? kWarps : 1, team_state);
    if (!p.use_queue) return;  // one task per block (teams) or warp: no claims, nothing to reset
    if (on_team) {
      if (threadIdx.x == 0)
        claimed = atomicAdd(reinterpret_cast<unsigned long long*>(p.queue) + 2, 1ull);
      __syncthreads();
      // `claimed` is written again only after the next team task's barrier, which every thread
      // reaches after reading it here.
      task = gridDim.x + static_cast<std::int64_t>(claimed);
      if (task < team_tasks) continue;
      on_team = false;
    }
    task = first_claim + claim();
  }
  if (!p.use_queue) return;
  if (lane == 0) {
    const unsigned long long left =
        atomicAdd(reinterpret_cast<unsigned long long*>(p.queue) + 1, 1ull);
    if (left == static_cast<unsigned long long>(warps) - 1) {
      p.queue[0] = 0;  // every other warp has left: no more claims this launch
      p.queue[1] = 0;
      p.queue[2] = 0;
    }
  }
}

}  // namespace trisparse::cuda::fused3s
