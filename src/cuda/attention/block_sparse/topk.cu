// Top-k block masks on the device (block routing, as topk_block_mask defines them on the CPU):
// one launch pools the block means of Q and K, one selects per (query block, head) the top_k key
// blocks by <mean Q, mean K> among those the block may attend, adds the diagonal block, and writes
// them in ascending order into the attention plan's blocks. Rows have fixed room (top_k + 1
// slots); unused slots hold the sequence's key-block count, whose first key lies past every
// row's last, so the attention kernels' walk ends there. No host synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <string>
#include <vector>

#include "../../common/arch/copy.cuh"
#include "../../common/arch/dependent_launch.cuh"
#include "../../common/arch/mma.cuh"
#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "device_plan.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

// The rows a block of the pooling averages: [row0, row0 + rows) of Q or K.
struct pool_block {
  std::int64_t row0;
  std::int32_t rows;
};

// What a selection block needs of its group of query blocks, in one 32-byte load: the pooled
// index of the sequence's first query and key block, the group's first query block in the
// sequence, and the sequence's query and key lengths.
struct alignas(32) select_group {
  std::int32_t q_base, k_base, first, lq, lk;
};

struct topk_device_plan {
  std::shared_ptr<block_sparse_device_plan> attention;
  std::int32_t heads = 0, dim = 0, pdim = 0, block = 0, top_k = 0, cap = 0;  // pdim: pooled_dim
  bool causal = false, keep_diagonal = false;
  std::int32_t q_blocks = 0, k_blocks = 0, max_k_blocks = 0, rows = 0, num_groups = 0;
  std::int32_t held = 0;  // keys a lane holds in registers in the selection (0: shared memory)
  bool dependent_launch = false;   // the selection as a programmatic dependent of the pooling
  std::int32_t select_shared = 0;  // a selection block's shared bytes
  unsigned pool_grid = 0;          // the pooling's blocks: one wave, or fewer where the tasks are
  std::int32_t pool_shared = 0;    // the pooling's shared bytes
  std::int64_t rows_q = 0, rows_k = 0;
  device_buffer<pool_block> pool_blocks;  // the query blocks', then the key blocks' rows
  device_buffer<select_group> groups;     // the selection's blocks
  // [blocks, heads] rows of pooled_bytes(pdim): the means as digits and a scale (pooled_dim)
  device_buffer<std::uint8_t> pooled_q, pooled_k;
};

namespace {

// The pooled means of a (block, head) are a row of pooled_dim(dim) dims (those past dim: zero),
// each mean x = m 2^e for one e per row, chosen so that the largest |x| gives |m| in [2^21, 2^22)
// (m an integer: 22 significant bits, as a float32 mean has 24), written as three signed 8-bit
// digits m = 2^16 d2 + 2^8 d1 + d0 (d1, d0 in [-128, 127], d2 in [-64, 64]). So the scores are
// integer products on the tensor cores (m16n8k32 s8, exact); the six digit products of weight
// 2^16 and above give each score to a relative 2^-22 of sum |q||k|, as three tf32 products did.
// A row in memory: per 32 dims (a k-step of the MMA) 96 bytes, plane d2, then d1, then d0, each
// plane 32 bytes in which lane t of the MMA finds its 8 bytes (dims 4t ... 4t + 3, then 16 + 4t
// ... 16 + 4t + 3: one register of each of its two fragments) at 8t; then the float 2^(e + 8)
// (NaN where a mean is not finite, 0 for a zero row) and padding to 16 bytes.
__host__ __device__ constexpr int pooled_dim(int dim) { return (dim + 31) / 32 * 32; }
__host__ __device__ constexpr int pooled_bytes(int pdim) { return 3 * pdim + 16; }
// Where the 4-byte group of dims d ... d + 3 (d a multiple of 4) of digit plane `plane` lies in
// its row.
__device__ __forceinline__ int digit_offset(int d, int plane) {
  const int in_step = d % 32;
  return d / 32 * 96 + plane * 32 + in_step % 16 / 4 * 8 + in_step / 16 * 4;
}

struct pool_params {
  const void* q;
  const void* k;
  std::int64_t q_row, q_head, k_row, k_head;
  const pool_block* blocks;  // the grid's, q_blocks query blocks first
  std::uint8_t *pooled_q, *pooled_k;
  std::int32_t q_blocks, blocks_total, heads, dim, pdim;
};

constexpr int kPoolThreads = 256;
constexpr int kPoolLoads = 16;  // 16-byte loads a thread keeps in flight

// 16 bytes read once: not kept in L1.
__device__ __forceinline__ uint4 load_streaming(const void* at) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(at));
  return v;
}

// Floats of shared memory a pooling warp uses: its row groups' sums (groups x dim <= 256), then
// the means in place (pdim).
__host__ __device__ constexpr int pool_warp_floats(int pdim) { return pdim > 256 ? pdim : 256; }

// Persistent warps: warp w of the grid pools tasks w, w + warps, ... (task = block b of the plan's
// table, q_blocks query blocks first, and head h: task b heads + h), each alone (no barrier: a
// warp's reduction overlaps the others' loads). A head's row is chunks = dim / 8 pieces of 8
// values (16-byte loads); lane l sums piece l % chunks of rows l / chunks, + groups, ... (groups
// = 32 / chunks row groups), or with more pieces than lanes, pieces l, l + 32, ... of every row;
// kPoolLoads of its rows are loaded before any is added (the loads in flight set the read's
// speed). The row groups' sums are added in a fixed order after, through the warp's shared
// memory, so the means, and the selection, are deterministic; then the warp writes the row in
// pooled_dim's format.
template <class T>
__global__ void __launch_bounds__(kPoolThreads, 2)
    pool_kernel(const __grid_constant__ pool_params p) {
  // The selection may be placed as soon as every pooling block has started (dependent_launch).
  arch::launch_dependents();
  constexpr int kWarps = kPoolThreads / 32;
  extern __shared__ float pool_shared[];  // kWarps x pool_warp_floats(pdim)
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const unsigned all = 0xffffffffu;
  float* sums = pool_shared + warp * pool_warp_floats(p.pdim);
  const int chunks = p.dim / 8, groups = max(1, 32 / chunks), group = lane / chunks;
  const int tasks = p.blocks_total * p.heads;
  for (int task = static_cast<int>(blockIdx.x) * kWarps + warp; task < tasks;
       task += static_cast<int>(gridDim.x) * kWarps) {
    const int b = task / p.heads, h = task - b * p.heads;
    const bool is_q = b < p.q_blocks;
    const int x = b - (is_q ? 0 : p.q_blocks);
    const pool_block block = p.blocks[b];
    const int rows = block.rows;
    const T* src = static_cast<const T*>(is_q ? p.q : p.k);
    const std::int64_t row_stride = is_q ? p.q_row : p.k_row;
    const T* head = src + block.row0 * row_stride + h * (is_q ? p.q_head : p.k_head);
    for (int chunk = lane % chunks; chunk < chunks && group < groups; chunk += 32) {
      // This lane's next row, and the bytes from one of its rows to the next.
      const char* next = reinterpret_cast<const char*>(head + group * row_stride + chunk * 8);
      const std::int64_t step = std::int64_t{groups} * row_stride * static_cast<int>(sizeof(T));
      float acc[8] = {};
      for (int b0 = group; b0 < rows; b0 += kPoolLoads * groups) {
        const int loads = (rows - b0 + groups - 1) / groups;  // this lane's, here
        uint4 raw[kPoolLoads];
#pragma unroll
        for (int u = 0; u < kPoolLoads; ++u) {
          raw[u] = u < loads ? load_streaming(next) : make_uint4(0u, 0u, 0u, 0u);
          next += step;
        }
#pragma unroll
        for (int u = 0; u < kPoolLoads; ++u) {
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += static_cast<float>(v[e]);
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sums[group * p.dim + chunk * 8 + e] = acc[e];
    }
    __syncwarp();
    // Mean d into place d (only this lane reads or writes dim d's sums), and the largest |mean|
    // (a non-negative float orders as its bits; NaN's are above infinity's).
    const float inv = 1.f / static_cast<float>(rows);
    unsigned top = 0u;
    for (int d = lane; d < p.dim; d += 32) {
      float acc = 0.f;
      for (int g = 0; g < groups; ++g) acc += sums[g * p.dim + d];
      sums[d] = acc * inv;
      top = max(top, __float_as_uint(fabsf(acc * inv)));
    }
    const float most = __uint_as_float(__reduce_max_sync(all, top));
    __syncwarp();
    const bool finite = most <= FLT_MAX;
    // e: the largest |mean| is 2^(e + 21) ... 2^(e + 22); m = mean 2^-e by one product where
    // 2^-e is a normal float (most >= 2^-105), else by scalbnf.
    const int e = most > 0.f && finite ? ilogbf(most) - 21 : 0;
    const bool product = e >= -126 && e <= 126;
    const float inverse = product ? __int_as_float((127 - e) << 23) : 0.f;
    std::uint8_t* row =
        (is_q ? p.pooled_q : p.pooled_k) + (std::int64_t{x} * p.heads + h) * pooled_bytes(p.pdim);
    for (int d = 4 * lane; d < p.pdim; d += 128) {  // dims d ... d + 3
      std::uint32_t plane[3] = {0u, 0u, 0u};        // their d2, d1, d0
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = d + j < p.dim && finite ? sums[d + j] : 0.f;
        const int m = __float2int_rn(product ? v * inverse : scalbnf(v, -e));  // |m| <= 2^22
        const int d0 = ((m + 128) & 255) - 128, m1 = (m - d0) >> 8;
        const int d1 = ((m1 + 128) & 255) - 128, d2 = (m1 - d1) >> 8;
        plane[0] |= (static_cast<std::uint32_t>(d2) & 255u) << (8 * j);
        plane[1] |= (static_cast<std::uint32_t>(d1) & 255u) << (8 * j);
        plane[2] |= (static_cast<std::uint32_t>(d0) & 255u) << (8 * j);
      }
#pragma unroll
      for (int k = 0; k < 3; ++k)
        *reinterpret_cast<std::uint32_t*>(row + digit_offset(d, k)) = plane[k];
    }
    if (lane == 0) {
      *reinterpret_cast<float*>(row + 3 * p.pdim) = !finite      ? __int_as_float(0x7fc00000)
                                                    : most > 0.f ? ldexpf(1.f, e + 8)
                                                                 : 0.f;
    }
    __syncwarp();  // read before the next task writes
  }
}

struct select_params {
  const std::uint8_t *pooled_q, *pooled_k;
  const select_group* groups;  // of each selection block, whatever its head
  std::int32_t* col_idx;
  std::int32_t heads, pdim, block, top_k, cap, max_k_blocks, rows;  // pdim: pooled_dim
  std::int32_t block_shift;  // log2(block) where block is a power of two, else -1
  bool causal, keep_diagonal;
};

constexpr int kChunk = 64;     // key blocks whose means a block stages at a time
constexpr int kStages = 4;     // chunks in the staging ring: three in flight while one is scored
constexpr int kTileRows = 16;  // the MMA's rows: query blocks per row tile
constexpr int kMaxRows = 32;   // query blocks per selection block, at most: two row tiles
constexpr int kTileWarps = 8;  // warps per row tile: one 8-key column of a chunk each

// Threads of a selection block of `rows` query blocks: kTileWarps warps per row tile.
__host__ __device__ constexpr int select_threads(int rows) {
  return (rows + kTileRows - 1) / kTileRows * kTileWarps * 32;
}

// Bytes from one staged key row to the next in shared memory: pooled_bytes rounded up to an odd
// multiple of 32, so that the fragments' 8-byte reads of a half warp (rows g ... g + 3 at 8t)
// fall in distinct banks.
__host__ __device__ constexpr int key_stride(int pdim) {
  const int units = (pooled_bytes(pdim) + 31) / 32;
  return 32 * (units % 2 == 1 ? units : units + 1);
}

// Shared bytes: kStages chunks of key rows (key_stride apart), then the scores of `rows` query
// blocks (score_floats each).
__host__ __device__ constexpr int select_bytes(int rows, int pdim, int score_floats) {
  return kStages * kChunk * key_stride(pdim) + 4 * rows * score_floats;
}

// Shared floats for one query block's scores: the 32 R keys the lanes load with R held in
// registers, or max_k_blocks, rounded up to 8 modulo 32: 16-byte aligned rows, and the scoring's
// 8-byte stores of rows g = 0 ... 7 (columns 2 t, 2 t + 1) fall in distinct banks of two
// wavefronts.
__host__ __device__ constexpr int score_floats(int held, int max_k_blocks) {
  const int n = held > 0 ? 32 * held : max_k_blocks;
  return (n + 23) / 32 * 32 + 8;
}

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
      const auto borrow = [&](unsigned& n, unsigned k) {
        asm("{\n .reg .u32 d;\n sub.cc.u32 d, %1, %2;\n subc.u32 %0, %0, 0;\n}"
            : "+r"(n)
            : "r"(k), "r"(x[r]));
      };
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

// A block per (group of `rows` <= 32 consecutive query blocks of one sequence, head), with 8 warps
// per row tile of 16 of them (select_threads): the key-block means are staged once for all its
// rows, so 32 rows a block read half the means from L2 that 16 do. Scores on tensor cores as
// integer products of the means' digits (pooled_dim; six m16n8k32 s8 products per 32 dims, in
// three accumulators by weight): the key rows staged through shared memory in chunks of 64
// (cp.async, the next chunks in flight while this one is scored), warp w computing the 16 x 8 tile
// of row tile w / 8 and keys 8 (w % 8) ... 8 (w % 8) + 7 of the chunk against the group's query
// rows (A fragments read from global memory; rows past the group are zero). Then warp w selects
// rows w and w + warps, then the next pair (select_rows). With PDIM (the pooled dim) known at
// compile time, a warp holds its A fragments in registers for all chunks; PDIM = 0 reads them at
// every k-step (any pooled dim).
template <int R, int PDIM>
__global__ void __launch_bounds__(select_threads(kMaxRows), 1)
    select_kernel(const __grid_constant__ select_params p) {
  // The attention after it (launched as a dependent) may take the SMs this grid leaves and set
  // up; it waits for this grid before it reads the mask.
  arch::launch_dependents();
  extern __shared__ uint4 shared4[];
  auto* shared = reinterpret_cast<std::uint8_t*>(shared4);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int threads = static_cast<int>(blockDim.x);
  const int g = lane / 4, t = lane % 4;            // the MMA fragments' row group and column
  const int tile = warp / kTileWarps * kTileRows;  // the warp's first row
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const int pdim = PDIM > 0 ? PDIM : p.pdim;
  const select_group group = p.groups[blockIdx.x / p.heads];
  const int lq = group.lq, lk = group.lk;
  const int row_bytes = pooled_bytes(pdim), stride = key_stride(pdim),
            stage_bytes = kChunk * stride;
  float* scores = reinterpret_cast<float*>(shared + kStages * stage_bytes);
  const int score_stride = score_floats(R, p.max_k_blocks);
  // x / block for x >= 0: a shift where block is a power of two.
  const auto in_blocks = [&](int x) {
    return p.block_shift >= 0 ? x >> p.block_shift : x / p.block;
  };
  const int nbq = in_blocks(lq + p.block - 1), nbk = in_blocks(lk + p.block - 1);
  const int rows = min(p.rows, nbq - group.first);  // the group's query blocks
  // The key blocks row i of the group may attend (0 past the group); the last row's (the most: it
  // grows with the row) bounds the staging loop.
  const auto allowed_of = [&](int i) {
    if (i >= rows) return 0;
    if (!p.causal) return nbk;
    const int last_row = min(lq, (group.first + i + 1) * p.block) - 1;
    const int last = min(last_row + lk - lq, lk - 1);
    return last < 0 ? 0 : in_blocks(last) + 1;
  };
  const int most = allowed_of(rows - 1);
  const std::int64_t k_stride = std::int64_t{p.heads} * row_bytes;
  const std::uint8_t* kp = p.pooled_k + (std::int64_t{group.k_base} * p.heads + h) * row_bytes;
  const int pieces = row_bytes / 16;  // 16-byte pieces a row (with PDIM: a constant divisor)
  // Thread i copies the pieces i, i + threads, ... of a chunk's rows.
  const auto stage = [&](int c0) {  // commits a group, empty past the last chunk
    std::uint8_t* to = shared + (c0 / kChunk % kStages) * stage_bytes;
    const std::uint8_t* from = kp + c0 * k_stride;
    const int n = min(kChunk, most - c0) * pieces;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) {
      const int row = i / pieces, piece = i - row * pieces;
      arch::cp_async_16(arch::shared_address(to + row * stride + 16 * piece),
                        from + row * k_stride + 16 * piece, true);
    }
    arch::cp_async_commit();
  };
  // Launched as a dependent of the pooling (dependent_launch): the means are complete from here.
  arch::wait_for_primary();
  // A ring of kStages chunks, kStages - 1 in flight: the staging waited on L2 latency with one.
  // Issued first, so that the key rows are on their way while the query rows are read.
  for (int i = 0; i < kStages - 1; ++i) stage(i * kChunk);
  // The warp's query rows tile + g and tile + g + 8 (null past the group) and their scales.
  const std::uint8_t* qs =
      p.pooled_q + ((std::int64_t{group.q_base} + group.first) * p.heads + h) * row_bytes;
  const std::int64_t q_stride = std::int64_t{p.heads} * row_bytes;
  const std::uint8_t* q_row[2] = {tile + g < rows ? qs + (tile + g) * q_stride : nullptr,
                                  tile + g + 8 < rows ? qs + (tile + g + 8) * q_stride : nullptr};
  float q_scale[2];
  for (int i = 0; i < 2; ++i)
    q_scale[i] = q_row[i] ? __ldg(reinterpret_cast<const float*>(q_row[i] + 3 * pdim)) : 0.f;
  // The A fragment of k-step s, digit plane k: rows g, g + 8 at dims 4t.., then 16 + 4t...
  const auto a_fragment = [&](int s, int k, std::uint32_t(&a)[4]) {
    uint2 v[2] = {};
    for (int i = 0; i < 2; ++i)
      if (q_row[i])
        v[i] = __ldg(reinterpret_cast<const uint2*>(q_row[i] + s * 96 + k * 32 + 8 * t));
    a[0] = v[0].x;
    a[1] = v[1].x;
    a[2] = v[0].y;
    a[3] = v[1].y;
  };
  std::uint32_t a_held[PDIM > 0 ? PDIM / 32 : 1][3][4];
  if constexpr (PDIM > 0) {
#pragma unroll
    for (int s = 0; s < PDIM / 32; ++s)
#pragma unroll
      for (int k = 0; k < 3; ++k) a_fragment(s, k, a_held[s][k]);
  }
  const int allowed_lo = allowed_of(tile + g), allowed_hi = allowed_of(tile + g + 8);
  for (int c0 = 0; c0 < most; c0 += kChunk) {
    arch::cp_async_wait<kStages - 2>();  // this thread's copies of chunk c0 have landed
    // Every thread's copies have landed and every thread is done with the chunk before: its
    // stage takes the chunk kStages - 1 ahead.
    __syncthreads();
    stage(c0 + (kStages - 1) * kChunk);
    const int column = 8 * (warp % kTileWarps), c = c0 + column;  // the warp's first key block
    if (c < most && tile < rows) {
      // B: key block c + g (rows past the chunk hold stale values whose scores are not stored).
      const std::uint8_t* chunk = shared + (c0 / kChunk % kStages) * stage_bytes;
      const std::uint8_t* key = chunk + (column + g) * stride + 8 * t;
      // The digit products by weight: 2^32 (d2 d2), 2^24 (d2 d1, d1 d2), 2^16 (d2 d0, d1 d1,
      // d0 d2); those below (a relative 2^-22 at most) are left out.
      int w32[4] = {}, w24[4] = {}, w16[4] = {};
#pragma unroll 2
      for (int s = 0; s < pdim / 32; ++s) {
        std::uint32_t b[3][2];
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          const uint2 v = *reinterpret_cast<const uint2*>(key + s * 96 + k * 32);
          b[k][0] = v.x;
          b[k][1] = v.y;
        }
        const auto products = [&](const std::uint32_t(&a)[3][4]) {
          arch::mma_16x8x32_s32_s8(w32, a[0], b[0]);
          arch::mma_16x8x32_s32_s8(w24, a[0], b[1]);
          arch::mma_16x8x32_s32_s8(w16, a[0], b[2]);
          arch::mma_16x8x32_s32_s8(w24, a[1], b[0]);
          arch::mma_16x8x32_s32_s8(w16, a[1], b[1]);
          arch::mma_16x8x32_s32_s8(w16, a[2], b[0]);
        };
        if constexpr (PDIM > 0) {
          products(a_held[s]);
        } else {
          std::uint32_t a[3][4];
          for (int k = 0; k < 3; ++k) a_fragment(s, k, a[k]);
          products(a);
        }
      }
      // The scales of key blocks c + 2 t and c + 2 t + 1 (the accumulators' columns).
      const std::uint8_t* k_scale = chunk + (column + 2 * t) * stride + 3 * pdim;
      const float k_scales[2] = {*reinterpret_cast<const float*>(k_scale),
                                 *reinterpret_cast<const float*>(k_scale + stride)};
      float acc[4];
      for (int e = 0; e < 4; ++e) {
        const float sum = fmaf(fmaf(static_cast<float>(w32[e]), 256.f, static_cast<float>(w24[e])),
                               256.f, static_cast<float>(w16[e]));
        acc[e] = sum * q_scale[e / 2] * k_scales[e % 2];
      }
      // acc: rows tile + g (0, 1) and tile + g + 8 (2, 3), key blocks c + 2 t and c + 2 t + 1:
      // one 8-byte store a row where both are attended.
      for (int half = 0; half < 2; ++half) {
        const int allowed = half == 0 ? allowed_lo : allowed_hi, col = c + 2 * t;
        float* to = scores + (tile + g + 8 * half) * score_stride + col;
        if (col + 1 < allowed)
          *reinterpret_cast<float2*>(to) = make_float2(acc[2 * half], acc[2 * half + 1]);
        else if (col < allowed)
          to[0] = acc[2 * half];
      }
    }
  }
  arch::cp_async_wait<0>();  // the empty groups past the last chunk
  __syncthreads();           // every score is in place
  // Warp w selects rows w and w + warps together (select_rows), then the next pair.
  const int warps = threads / 32;
  const auto job = [&](int i) {
    const int r = group.first + i;
    // The block holding the key aligned with the query block's last row (< allowed).
    const int aligned = min(lq, (r + 1) * p.block) - 1 + lk - lq;
    const int diagonal =
        p.keep_diagonal && aligned >= 0 && lk > 0 ? in_blocks(min(aligned, lk - 1)) : -1;
    return row_job{
        scores + i * score_stride, allowed_of(i), diagonal,
        p.col_idx + (std::int64_t{group.q_base} * p.heads + std::int64_t{h} * nbq + r) * p.cap};
  };
  for (int i = warp; i < rows; i += 2 * warps) {
    const int j = i + warps;
    if constexpr (R > 0) {
      if (j < rows) {
        select_rows<R, 2>({job(i), job(j)}, p.top_k, p.cap, nbk);
        continue;
      }
    }
    select_rows<R, 1>({job(i)}, p.top_k, p.cap, nbk);
    if (j < rows) select_rows<R, 1>({job(j)}, p.top_k, p.cap, nbk);
  }
}

// The selection kernel holding R keys per lane in registers: the fewest that cover max_k_blocks,
// up to 32 (1024 key blocks); beyond, R = 0 (keys read from shared memory in every pass). The
// A fragments in registers where the pooled dim is 64 (head dims 33-64); other dims read them at
// every k-step.
using select_fn = void (*)(select_params);
template <int PDIM>
select_fn select_kernel_held(int held) {
  switch (held) {
    case 2:
      return select_kernel<2, PDIM>;
    case 4:
      return select_kernel<4, PDIM>;
    case 8:
      return select_kernel<8, PDIM>;
    case 16:
      return select_kernel<16, PDIM>;
    case 32:
      return select_kernel<32, PDIM>;
    default:
      return select_kernel<0, PDIM>;
  }
}
select_fn select_kernel_for(int held, int pdim) {
  return pdim == 64 ? select_kernel_held<64>(held) : select_kernel_held<0>(held);
}

int held_keys(int max_k_blocks) {
  for (const int r : {2, 4, 8, 16, 32})
    if (32 * r >= max_k_blocks) return r;
  return 0;
}

void check_input(const topk_device_plan& t, const tensor_view& v, std::int64_t rows,
                 const char* name) {
  if (v.where != device_kind::cuda || v.rows != rows || v.heads != t.heads || v.dim != t.dim ||
      (v.type != dtype::f16 && v.type != dtype::bf16)) {
    throw invalid_input(std::string("top-k selection: ") + name + " must be a CUDA f16 or bf16 [" +
                        std::to_string(rows) + ", " + std::to_string(t.heads) + ", " +
                        std::to_string(t.dim) + "] tensor");
  }
  check_16byte_rows(v, name);
}

}  // namespace

std::shared_ptr<topk_device_plan> make_topk_plan(const block_sparse_mask& skeleton,
                                                 std::int64_t top_k, bool keep_diagonal,
                                                 std::int64_t dim, block_kernel kernel,
                                                 stream_ref stream) {
  if (dim % 8 != 0) {
    throw invalid_input("top-k selection: head_dim must be a multiple of 8, not " +
                        std::to_string(dim));
  }
  auto t = std::make_shared<topk_device_plan>();
  t->attention = make_block_sparse_plan(skeleton, kernel, stream);
  t->heads = static_cast<std::int32_t>(skeleton.heads);
  t->dim = static_cast<std::int32_t>(dim);
  t->pdim = pooled_dim(t->dim);
  t->block = static_cast<std::int32_t>(skeleton.block);
  t->top_k = static_cast<std::int32_t>(top_k);
  t->cap = static_cast<std::int32_t>(top_k + (keep_diagonal ? 1 : 0));
  t->causal = skeleton.causal;
  t->keep_diagonal = keep_diagonal;
  t->rows_q = skeleton.cu_seqlens_q.back();
  t->rows_k = skeleton.cu_seqlens_k.back();
  std::vector<pool_block> q_blocks, k_blocks;
  std::vector<std::int32_t> q_base, k_base;
  // Each sequence's blocks of `block` rows (the last one shorter), from its first row in cu.
  const auto add_blocks = [&](const std::vector<std::int64_t>& cu, std::int64_t b,
                              std::vector<pool_block>& blocks, std::vector<std::int32_t>& base) {
    base.push_back(static_cast<std::int32_t>(blocks.size()));
    for (std::int64_t r = cu[b]; r < cu[b + 1]; r += t->block)
      blocks.push_back(
          {r, static_cast<std::int32_t>(std::min<std::int64_t>(t->block, cu[b + 1] - r))});
    return static_cast<std::int32_t>(blocks.size()) - base.back();
  };
  for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
    add_blocks(skeleton.cu_seqlens_q, b, q_blocks, q_base);
    t->max_k_blocks =
        std::max(t->max_k_blocks, add_blocks(skeleton.cu_seqlens_k, b, k_blocks, k_base));
  }
  t->q_blocks = static_cast<std::int32_t>(q_blocks.size());
  t->k_blocks = static_cast<std::int32_t>(k_blocks.size());
  // Query blocks per selection block: the most of 32, 16, ..., 1 whose scores fit in shared
  // memory, then halved (down to 4) while the blocks would not cover half the SMs (a block of 32
  // rows runs 16 warps: one fills an SM's warps as two blocks of 16 rows do).
  int device = 0, limit = 0, sms = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  t->held = held_keys(t->max_k_blocks);
  for (int rows = kMaxRows; rows >= 1 && t->rows == 0; rows /= 2)
    if (select_bytes(rows, t->pdim, score_floats(t->held, t->max_k_blocks)) <= limit)
      t->rows = rows;
  if (t->rows == 0) {
    throw not_supported("top-k selection: " + std::to_string(t->max_k_blocks) +
                        " key blocks in one sequence need more shared memory than the device has");
  }
  const auto groups_of = [&](int rows) {
    std::vector<select_group> groups;
    for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
      const auto lq = static_cast<std::int32_t>(skeleton.len_q(b)),
                 lk = static_cast<std::int32_t>(skeleton.cu_seqlens_k[b + 1] -
                                                skeleton.cu_seqlens_k[b]);
      const int nbq = (lq + t->block - 1) / t->block;
      const auto at = static_cast<std::size_t>(b);
      for (int r = 0; r < nbq; r += rows) groups.push_back({q_base[at], k_base[at], r, lq, lk});
    }
    return groups;
  };
  while (t->rows > 4 && static_cast<std::int64_t>(groups_of(t->rows).size()) * t->heads * 2 < sms)
    t->rows /= 2;
  const std::vector<select_group> groups = groups_of(t->rows);
  // Launched as dependents (sm_90), the selection's blocks take an SM as the pooling leaves it
  // and start before it ends (a stream-ordered launch starts about 2 us later). Blocks of 32 rows
  // (16 warps, most of an SM's shared memory) take an SM each. Smaller blocks would be placed two
  // to the SMs that the pooling leaves first while other SMs stay empty, so they are launched as
  // dependents only where they are one wave or less, each given more than half an SM's shared
  // memory; else they wait in stream order.
  t->select_shared = select_bytes(t->rows, t->pdim, score_floats(t->held, t->max_k_blocks));
  const bool can_depend = arch::waits_for_primary(select_kernel_for(t->held, t->pdim));
  t->dependent_launch = can_depend && t->rows == kMaxRows;
  if (can_depend && t->rows < kMaxRows &&
      static_cast<std::int64_t>(groups.size()) * t->heads <= sms) {
    t->dependent_launch = true;
    t->select_shared = std::max(t->select_shared, limit / 2 + 1024);
  }
  TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(select_kernel_for(t->held, t->pdim),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          t->select_shared));
  t->num_groups = static_cast<std::int32_t>(groups.size());
  t->groups = device_buffer<select_group>(groups);
  q_blocks.insert(q_blocks.end(), k_blocks.begin(), k_blocks.end());
  t->pool_blocks = device_buffer<pool_block>(q_blocks);
  // The pooling's persistent warps: as many blocks as fit at once, or one per kPoolThreads / 32
  // tasks where fewer.
  t->pool_shared = kPoolThreads / 32 * pool_warp_floats(t->pdim) * 4;
  if (t->pool_shared > limit) {
    throw not_supported("top-k selection: head_dim " + std::to_string(t->dim) +
                        " needs more shared memory for the pooling than the device has");
  }
  for (const auto pool : {pool_kernel<__half>, pool_kernel<__nv_bfloat16>}) {
    TRISPARSE_CUDA_TRY(
        cudaFuncSetAttribute(pool, cudaFuncAttributeMaxDynamicSharedMemorySize, t->pool_shared));
  }
  int pool_per_sm = 0;
  TRISPARSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &pool_per_sm, pool_kernel<__half>, kPoolThreads, t->pool_shared));
  const std::int64_t pool_tasks = std::int64_t{t->q_blocks + t->k_blocks} * t->heads;
  t->pool_grid = static_cast<unsigned>(
      std::min<std::int64_t>((pool_tasks + kPoolThreads / 32 - 1) / (kPoolThreads / 32),
                             std::int64_t{std::max(1, pool_per_sm)} * sms));
  const auto row_bytes = static_cast<std::size_t>(pooled_bytes(t->pdim));
  t->pooled_q =
      device_buffer<std::uint8_t>(static_cast<std::size_t>(t->q_blocks) * t->heads * row_bytes);
  t->pooled_k =
      device_buffer<std::uint8_t>(static_cast<std::size_t>(t->k_blocks) * t->heads * row_bytes);
  // The rows' padding past the scale is copied with it but never read; zeroed once. Done before
  // the plan is returned, whatever stream select() runs on later.
  for (auto* pooled : {&t->pooled_q, &t->pooled_k}) {
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(pooled->data(), 0, pooled->size(),
                                       static_cast<cudaStream_t>(stream.handle)));
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  return t;
}

const block_sparse_device_plan& attention_of(const topk_device_plan& t) { return *t.attention; }

void select_topk(topk_device_plan& t, const tensor_view& q, const tensor_view& k,
                 stream_ref stream) {
  check_input(t, q, t.rows_q, "q");
  check_input(t, k, t.rows_k, "k");
  if (k.type != q.type) throw invalid_input("top-k selection: q and k need the same dtype");
  expect_current_device(t.attention->device);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  block_sparse_device_plan& a = *t.attention;
  const pool_params pp{q.data,
                       k.data,
                       q.row_stride,
                       q.head_stride,
                       k.row_stride,
                       k.head_stride,
                       t.pool_blocks.data(),
                       t.pooled_q.data(),
                       t.pooled_k.data(),
                       t.q_blocks,
                       t.q_blocks + t.k_blocks,
                       t.heads,
                       t.dim,
                       t.pdim};
  if (t.pool_grid == 0) return;
  if (q.type == dtype::f16)
    pool_kernel<__half><<<t.pool_grid, kPoolThreads, t.pool_shared, s>>>(pp);
  else
    pool_kernel<__nv_bfloat16><<<t.pool_grid, kPoolThreads, t.pool_shared, s>>>(pp);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  select_params sp{};
  sp.pooled_q = t.pooled_q.data();
  sp.pooled_k = t.pooled_k.data();
  sp.groups = t.groups.data();
  sp.col_idx = a.col_idx.data();
  sp.heads = t.heads;
  sp.pdim = t.pdim;
  sp.block = t.block;
  sp.block_shift =
      (t.block & (t.block - 1)) == 0 ? std::countr_zero(static_cast<unsigned>(t.block)) : -1;
  sp.top_k = t.top_k;
  sp.cap = t.cap;
  sp.max_k_blocks = t.max_k_blocks;
  sp.rows = t.rows;
  sp.causal = t.causal;
  sp.keep_diagonal = t.keep_diagonal;
  const std::int64_t blocks = std::int64_t{t.num_groups} * t.heads;
  if (blocks == 0 || t.cap == 0) return;
  arch::launch(select_kernel_for(t.held, t.pdim), dim3(static_cast<unsigned>(blocks)),
               dim3(static_cast<unsigned>(select_threads(t.rows))),
               static_cast<std::size_t>(t.select_shared), s, t.dependent_launch, sp);
}

std::vector<std::int32_t> download_blocks(const topk_device_plan& t, stream_ref stream) {
  std::vector<std::int32_t> cols(t.attention->col_idx.size());
  const auto s = static_cast<cudaStream_t>(stream.handle);
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(cols.data(), t.attention->col_idx.data(),
                                     cols.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return cols;
}

}  // namespace trisparse::cuda
