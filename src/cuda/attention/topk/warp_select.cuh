#pragma once
// One warp's top-k selection over a row of scores (order keys, range halving, warp sort).
#include <cfloat>
#include <cstdint>

#include "../../common/arch/math.cuh"

namespace trisparse::cuda::topk {

// The order-preserving unsigned key of a score (larger score, larger key): negative numbers get
// all bits flipped, the others the sign bit set. A NaN's raw key lies below -inf's (kLowestKey) or
// above +inf's (kHighestKey); order_key gives NaN 0, below every number's, so it is never selected.
__device__ __forceinline__ unsigned raw_order_key(float v) {
  const unsigned bits = __float_as_uint(v);
  return bits ^ (static_cast<unsigned>(static_cast<int>(bits) >> 31) | 0x80000000u);
}
constexpr unsigned kLowestKey = 0x007fffffu, kHighestKey = 0xff800000u;
__device__ __forceinline__ unsigned order_key(float v) { return v != v ? 0u : raw_order_key(v); }

// before[r] = the sum of x[r] over the lanes below this one, for M values at once (their shuffles
// interleaved).
template <int M>
__device__ __forceinline__ void lanes_before_sums(const int (&x)[M], int (&before)[M], int lane) {
  int sum[M];
#pragma unroll
  for (int r = 0; r < M; ++r) sum[r] = x[r];
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const int y = __shfl_up_sync(0xffffffffu, sum[r], d);
      if (lane >= d) sum[r] += y;
    }
  }
#pragma unroll
  for (int r = 0; r < M; ++r) before[r] = sum[r] - x[r];
}

// What one row of a selection needs: its scores (overwritten), the key blocks it may attend, its
// diagonal block (-1: none) and where its row of the mask goes.
struct row_job {
  float* score;
  int allowed, diagonal;
  std::int32_t* out;
};

// One warp's selection over the scores of NR rows (NR = 2 only with R > 0): for each, the top
// min(top_k, numbers among its `allowed` key blocks) (ties to the lower block; NaN never) and its
// diagonal block, written in ascending order to out[0, n); out[n, cap) gets `past` (the key-block
// count). The rows' steps are interleaved, so that one row's shuffles and reductions wait while
// the other's issue. The scores become order keys (order_key); the keep-th largest key t is found
// by halving a range of keys that holds it (a pass per halving, counting the keys >= its middle);
// the keys above t are taken, then the first keep - (count above t) equal to t. Lane l holds the
// keys of blocks l R ... l R + R - 1 in registers (allowed <= 32 R), or with R = 0 they stay in
// shared memory (the scores' place) and are read in every pass. With registers, the range starts
// at the smallest lane maximum (where keep <= 32) and ends past the largest key, and as soon as
// the keys in it are at most 32 they are gathered, one per lane, and sorted across the warp,
// which gives t; the chosen blocks are then a mask per lane, written in order by a warp scan.
template <int R, int NR>
__device__ void select_rows(const row_job (&job)[NR], int top_k, int cap, int past) {
  static_assert(NR == 1 || (NR == 2 && R > 0), "two rows at once only with keys in registers");
  constexpr int kHeld = R > 0 ? R : 1;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned all = 0xffffffffu;
  const auto keys = [&](int r) { return reinterpret_cast<unsigned*>(job[r].score); };
  unsigned held[NR][kHeld];
  // The keys in registers are taken raw (a NaN's lies outside [kLowestKey, kHighestKey]). Where
  // some are not attended they are made 0 one by one, with the NaN's; where every one is, that
  // is done only if their extremes show a NaN.
  bool every[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) every[r] = R > 0 && job[r].allowed == 32 * R;
  const auto sanitize = [&](int r, int mine) {  // keys mine, mine + 1, ... not attended
#pragma unroll
    for (int j = 0; j < kHeld; ++j)
      held[r][j] =
          j < mine && held[r][j] - kLowestKey <= kHighestKey - kLowestKey ? held[r][j] : 0u;
  };
  if constexpr (R > 0) {
    // Lane l holds keys l R ... l R + R - 1 (16-byte loads where R allows).
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float* score = job[r].score + lane * R;
      if constexpr (R % 4 == 0) {
#pragma unroll
        for (int j = 0; j < R; j += 4) {
          const float4 x = *reinterpret_cast<const float4*>(score + j);
          held[r][j] = raw_order_key(x.x);
          held[r][j + 1] = raw_order_key(x.y);
          held[r][j + 2] = raw_order_key(x.z);
          held[r][j + 3] = raw_order_key(x.w);
        }
      } else {
#pragma unroll
        for (int j = 0; j < R; ++j) held[r][j] = raw_order_key(score[j]);
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (!every[r]) sanitize(r, job[r].allowed - lane * R);
  } else {
    for (int c = lane; c < job[0].allowed; c += 32) keys(0)[c] = order_key(job[0].score[c]);
  }
  __syncwarp();  // every lane has read its scores before the gathering below overwrites them
  // The warp's count of keys >= x[r] in each row r: the keys visited less the borrows of k - x
  // (two instructions a key; the keys past `allowed` are 0, below any x > 0), in two counters
  // (even and odd slices) that halve the dependent chain.
  const auto at_least = [&](const unsigned(&x)[NR], int(&count)[NR]) {
    unsigned even[NR], odd[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      even[r] = 0u;
      odd[r] = 0u;
      const auto borrow = [&](unsigned& n, unsigned k) { arch::count_borrow(n, k, x[r]); };
      if constexpr (R > 0) {
#pragma unroll
        for (int j = 0; j < R; ++j) borrow(j % 2 == 1 ? odd[r] : even[r], held[r][j]);
      } else {
        const int allowed = job[0].allowed;
#pragma unroll 4
        for (int j = 0; j < (allowed + 31) / 32; ++j) {
          const int c = lane + 32 * j;
          borrow(even[r], c < allowed ? keys(0)[c] : 0u);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int visited = 32 * (R > 0 ? R : (job[0].allowed + 31) / 32);
      count[r] = visited + static_cast<int>(__reduce_add_sync(all, even[r] + odd[r]));
    }
  };
  // The largest key of this lane (R > 0), and the count of numbers (NaN's key is 0).
  unsigned lane_max[NR];
  const auto lane_extreme = [&](int r) {
    lane_max[r] = 0u;
#pragma unroll
    for (int j = 0; j < (R > 0 ? R : 0); ++j) lane_max[r] = max(lane_max[r], held[r][j]);
  };
  int numbers[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    lane_extreme(r);
    numbers[r] = -1;
  }
  // The warp's largest key of each row (R > 0). Where every key is attended and the warp's
  // extremes are numbers' keys, the row's numbers are its length.
  unsigned most[NR];
  if constexpr (R > 0) {
#pragma unroll
    for (int r = 0; r < NR; ++r) most[r] = __reduce_max_sync(all, lane_max[r]);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (!every[r] || most[r] > kHighestKey) continue;
      unsigned lane_min = ~0u;
#pragma unroll
      for (int j = 0; j < R; ++j) lane_min = min(lane_min, held[r][j]);
      if (__reduce_min_sync(all, lane_min) >= kLowestKey) numbers[r] = job[r].allowed;
    }
  }
  bool count_numbers = false;
#pragma unroll
  for (int r = 0; r < NR; ++r) count_numbers |= numbers[r] < 0;
  if (count_numbers) {
    unsigned one[NR];
    int counted[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      one[r] = 1u;
      if (numbers[r] < 0 && every[r]) {
        sanitize(r, R);
        lane_extreme(r);
        if constexpr (R > 0) most[r] = __reduce_max_sync(all, lane_max[r]);
      }
    }
    at_least(one, counted);
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (numbers[r] < 0) numbers[r] = counted[r];
  }
  // t[r] is row r's keep-th largest key. It stays in [lo, hi): at least keep keys are >= lo
  // (from_lo of them, an upper bound until a pass counts), above = the count of keys >= hi <
  // keep. Each pass counts the keys >= the middle. With registers the passes stop as soon as
  // the keys in [lo, hi) fit one per lane; they are gathered and sorted, which gives t. keep = 0:
  // t = ~0u, which no key reaches (valid keys are < 0xffffffff).
  int keep[NR], from_lo[NR], above[NR], need[NR];
  unsigned lo[NR], hi[NR], t[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    keep[r] = min(top_k, numbers[r]);
    lo[r] = 1u;  // every valid key is in [1, 0xffffffff)
    hi[r] = ~0u;
    from_lo[r] = numbers[r];
    above[r] = 0;
    if constexpr (R > 0) {
      hi[r] = most[r] + 1u;
      // The 32 lane maxima are keys >= the smallest of them.
      const unsigned smallest = __reduce_min_sync(all, lane_max[r]);
      if (keep[r] <= 32) lo[r] = max(lo[r], smallest);
    }
  }
  for (;;) {
    bool halving[NR], any = false;
    unsigned middle[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      halving[r] = keep[r] > 0 && hi[r] - lo[r] > 1u && (R == 0 || from_lo[r] - above[r] > 32);
      any |= halving[r];
      middle[r] = lo[r] + (hi[r] - lo[r]) / 2u;
    }
    if (!any) break;
    int count[NR];
    at_least(middle, count);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (!halving[r]) continue;
      if (count[r] >= keep[r]) {
        lo[r] = middle[r];
        from_lo[r] = count[r];
      } else {
        hi[r] = middle[r];
        above[r] = count[r];
      }
    }
  }
  bool gather[NR], any_gather = false;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    t[r] = keep[r] > 0 ? lo[r] : ~0u;  // where [lo, hi) is one key wide
    need[r] = keep[r] > 0 ? keep[r] - above[r] : 0;
    gather[r] = R > 0 && keep[r] > 0 && hi[r] - lo[r] > 1u;
    any_gather |= gather[r];
  }
  if constexpr (R > 0) {
    if (any_gather) {
      // The keys in [lo, hi): at most 32, at least keep - above of them; a mask per lane, then
      // gathered into the scores' place in lane order, one per lane.
      unsigned window[NR];
      int mine[NR], at[NR], gathered[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        window[r] = 0u;
        const unsigned span = hi[r] - lo[r];
#pragma unroll
        for (int j = 0; j < R; ++j)
          if (gather[r] && held[r][j] - lo[r] < span) window[r] |= 1u << j;
        mine[r] = __popc(window[r]);
      }
      lanes_before_sums(mine, at, lane);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        gathered[r] = __shfl_sync(all, at[r] + mine[r], 31);
        unsigned* to = keys(r) + at[r];
#pragma unroll
        for (int j = 0; j < R; ++j)
          if ((window[r] >> j & 1u) != 0u) *to++ = held[r][j];
      }
      __syncwarp();
      // Sorted in descending order across the warp (bitonic; lanes past them hold 0), so t is
      // the (keep - above)-th.
      unsigned v[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) v[r] = lane < gathered[r] ? keys(r)[lane] : 0u;
#pragma unroll
      for (int size = 2; size <= 32; size *= 2) {
#pragma unroll
        for (int stride = size / 2; stride > 0; stride /= 2) {
          const bool larger = ((lane & stride) == 0) == ((lane & size) == 0);
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            const unsigned other = __shfl_xor_sync(all, v[r], stride);
            v[r] = larger ? max(v[r], other) : min(v[r], other);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const unsigned at_need = __shfl_sync(all, v[r], max(need[r], 1) - 1);
        const int higher = __popc(__ballot_sync(all, v[r] > at_need));
        if (gather[r]) {
          t[r] = at_need;
          need[r] -= higher;
        }
      }
    }
  }
  int n[NR];  // blocks written
  if constexpr (R > 0) {
    // Bit j of `taken`: block l R + j chosen. First every key >= t; where that is more than keep,
    // the ties past the first `need` (in block order: the lanes before, then this lane's lower
    // bits) are dropped.
    unsigned taken[NR];
    int total[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      taken[r] = 0u;
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (held[r][j] >= t[r]) taken[r] |= 1u << j;
      total[r] = static_cast<int>(__reduce_add_sync(all, static_cast<unsigned>(__popc(taken[r]))));
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (total[r] <= keep[r]) continue;
      unsigned ties = 0u;
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (held[r][j] == t[r]) ties |= 1u << j;
      const int mine[1] = {__popc(ties)};
      int before[1];
      lanes_before_sums(mine, before, lane);
      const int kept = max(0, min(mine[0], need[r] - before[0]));
      for (int drop = mine[0] - kept; drop > 0; --drop) {
        const unsigned last = 1u << (31 - __clz(ties));
        ties &= ~last;
        taken[r] &= ~last;
      }
    }
    int chosen[NR], at[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int diagonal = job[r].diagonal;
      if (diagonal >= lane * R && diagonal < lane * R + R) taken[r] |= 1u << (diagonal - lane * R);
      chosen[r] = __popc(taken[r]);
    }
    lanes_before_sums(chosen, at, lane);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      n[r] = __shfl_sync(all, at[r] + chosen[r], 31);
      for (unsigned bits = taken[r]; bits != 0u; bits &= bits - 1u)
        job[r].out[at[r]++] = lane * R + __ffs(static_cast<int>(bits)) - 1;
    }
  } else {
    // The output in block order: lane l's keys are the slice l S ... l S + S - 1 of shared memory,
    // so a block's place is the chosen blocks of the lanes before (a warp scan) plus those before
    // it in its slice; likewise a tie's rank among the ties.
    const int allowed = job[0].allowed, span = (allowed + 31) / 32;
    const unsigned* key = keys(0);
    const auto blocked = [&](auto&& f) {
      for (int c = lane * span; c < min(allowed, (lane + 1) * span); ++c) f(c, key[c]);
    };
    int ties[1] = {0}, tie[1];
    blocked([&](int, unsigned k) { ties[0] += k == t[0] ? 1 : 0; });
    lanes_before_sums(ties, tie, lane);
    const auto take = [&](int c, unsigned k) {
      const bool in = k > t[0] || (k == t[0] && tie[0] < need[0]) || c == job[0].diagonal;
      tie[0] += k == t[0] ? 1 : 0;
      return in;
    };
    int chosen[1] = {0}, at[1];
    blocked([&](int c, unsigned k) { chosen[0] += take(c, k) ? 1 : 0; });
    lanes_before_sums(chosen, at, lane);
    n[0] = __shfl_sync(all, at[0] + chosen[0], 31);
    lanes_before_sums(ties, tie, lane);
    blocked([&](int c, unsigned k) {
      if (take(c, k)) job[0].out[at[0]++] = c;
    });
  }
#pragma unroll
  for (int r = 0; r < NR; ++r)
    for (int i = n[r] + lane; i < cap; i += 32) job[r].out[i] = past;
}

}  // namespace trisparse::cuda::topk
