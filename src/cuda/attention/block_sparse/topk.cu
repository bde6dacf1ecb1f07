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
#include <string>
#include <vector>

#include "../../common/arch/copy.cuh"
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
  bool dependent_launch = false;  // the selection as a programmatic dependent of the pooling
  unsigned pool_grid = 0;         // the pooling's blocks: one wave, or fewer where the tasks are
  std::int64_t rows_q = 0, rows_k = 0;
  device_buffer<pool_block> pool_blocks;    // the query blocks', then the key blocks' rows
  device_buffer<select_group> groups;       // the selection's blocks
  device_buffer<float> pooled_q, pooled_k;  // [blocks, heads, pdim], dims in pooled_position order
};

namespace {

// The pooled means of a head are pooled_dim(dim) floats (dims past dim: zero), dim d at
// pooled_position(d): within each group of 16 dims, lane t of the scoring MMA finds the 4 values
// it reads for two k-steps of 8 together (dims t, t + 4, t + 8, t + 12: the tf32 m16n8k8
// fragments' a0 and a2, or b0 and b1, of both steps), so one 16-byte shared load serves both.
__host__ __device__ constexpr int pooled_dim(int dim) { return (dim + 15) / 16 * 16; }
__device__ __forceinline__ int pooled_position(int d) {
  const int in_group = d % 16;
  return d - in_group + 4 * (in_group % 4) + 2 * (in_group / 8) + (in_group / 4) % 2;
}

struct pool_params {
  const void* q;
  const void* k;
  std::int64_t q_row, q_head, k_row, k_head;
  const pool_block* blocks;  // the grid's, q_blocks query blocks first
  float *pooled_q, *pooled_k;
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

// Persistent warps: warp w of the grid pools tasks w, w + warps, ... (task = block b of the plan's
// table, q_blocks query blocks first, and head h: task b heads + h), each alone (no barrier: a
// warp's reduction overlaps the others' loads). A head's row is chunks = dim / 8 pieces of 8
// values (16-byte loads); lane l sums piece l % chunks of rows l / chunks, + groups, ... (groups
// = 32 / chunks row groups), or with more pieces than lanes, pieces l, l + 32, ... of every row;
// kPoolLoads of its rows are loaded before any is added (the loads in flight set the read's
// speed). The row groups' sums are added in a fixed order after, through the warp's shared
// memory, so the means, and the selection, are deterministic. Means are stored at their
// pooled_position.
template <class T>
__global__ void __launch_bounds__(kPoolThreads, 2)
    pool_kernel(const __grid_constant__ pool_params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The selection may be placed as soon as every pooling block has started (dependent_launch).
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  constexpr int kWarps = kPoolThreads / 32;
  __shared__ float partial[kWarps][256];  // a warp's row groups' sums: groups x dim <= 256
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  float* sums = partial[warp];
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
    float* dst = (is_q ? p.pooled_q : p.pooled_k) + (std::int64_t{x} * p.heads + h) * p.pdim;
    const float inv = 1.f / static_cast<float>(rows);
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
      for (int e = 0; e < 8; ++e) {
        if (groups == 1)
          dst[pooled_position(chunk * 8 + e)] = acc[e] * inv;
        else
          sums[group * p.dim + chunk * 8 + e] = acc[e];
      }
    }
    if (groups > 1) {
      __syncwarp();
      for (int d = lane; d < p.dim; d += 32) {
        float acc = 0.f;
        for (int g = 0; g < groups; ++g) acc += sums[g * p.dim + d];
        dst[pooled_position(d)] = acc * inv;
      }
      __syncwarp();  // read before the next task writes
    }
  }
}

struct select_params {
  const float *pooled_q, *pooled_k;
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

// Floats of a row of means in shared memory: pdim (a multiple of 16) rounded up to 16 modulo 32,
// so that the fragments' 16-byte reads of a quarter warp (rows g, g + 1 at column 4 t) fall in
// distinct banks.
__host__ __device__ constexpr int row_floats(int pdim) {
  return pdim % 32 == 16 ? pdim : pdim + 16;
}

// Shared floats: kStages chunks of key means (rows of row_floats), the query means' high and low
// tf32 parts (whole row tiles, in MMA fragment order: query_fragment_index), then the scores of
// `rows` query blocks (score_floats each).
__host__ __device__ constexpr int select_floats(int rows, int pdim, int score_floats) {
  const int tile_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  return kStages * kChunk * row_floats(pdim) + 2 * tile_rows * pdim + rows * score_floats;
}

// Where the query mean of row `row` (of the group) at pooled position `d` goes: the A fragment
// of the tf32 m16n8k8 for its row tile and k-step, as the float4 (a0, a1, a2, a3) of its lane,
// so that a lane reads a k-step's fragment with one 16-byte load and no moves.
__device__ __forceinline__ int query_fragment_index(int row, int d, int pdim) {
  const int tile = row / kTileRows, g = row % 8, upper = row % kTileRows / 8;  // a1, a3: rows g + 8
  const int in_group = d % 16, t = in_group / 4, slot = in_group % 4;  // pooled_position's order
  const int step = d / 16 * 2 + slot / 2, e = slot % 2;                // e = 1: a2, a3 (dims t + 4)
  return ((tile * (pdim / 8) + step) * 32 + 4 * g + t) * 4 + 2 * e + upper;
}

// Shared floats for one query block's scores: the 32 R keys the lanes load with R held in
// registers, or max_k_blocks, rounded up to 8 modulo 32: 16-byte aligned rows, and the scoring's
// 8-byte stores of rows g = 0 ... 7 (columns 2 t, 2 t + 1) fall in distinct banks of two
// wavefronts.
__host__ __device__ constexpr int score_floats(int held, int max_k_blocks) {
  const int n = held > 0 ? 32 * held : max_k_blocks;
  return (n + 23) / 32 * 32 + 8;
}

// The order-preserving unsigned key of a score (larger score, larger key); NaN gets 0, below every
// number's (-inf's is 0x007fffff), so it is never selected. Negative numbers get all bits flipped,
// the others the sign bit set.
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned bits = __float_as_uint(v);
  const unsigned key = bits ^ (static_cast<unsigned>(static_cast<int>(bits) >> 31) | 0x80000000u);
  return v != v ? 0u : key;
}

// One warp's selection over the scores of the `allowed` key blocks in shared memory: the top
// min(top_k, numbers among them) (ties to the lower block; NaN never) and the diagonal block (-1:
// none), written in ascending order to out[0, n); out[n, cap) gets `past` (the key-block count).
// The scores become order keys (order_key); the keep-th largest key t is found bit by bit from the
// top (a pass per bit counting keys >= t | bit); the keys above t are taken, then the first
// keep - (count above t) equal to t. Lane l holds the keys of blocks l R ... l R + R - 1 in
// registers (allowed <= 32 R), or with R = 0 they stay in shared memory (the scores' place) and
// are read in every pass. With registers, the bits shared by the largest key and the smallest
// lane maximum are decided without a pass (where keep <= 32), and as soon as the keys sharing
// t's decided bits are at most 32 they are gathered, one per lane, and sorted across the warp,
// which gives t; the chosen blocks are then a mask per lane, written in order by a warp scan.
template <int R>
__device__ void select_row(float* score, int allowed, int top_k, int diagonal, std::int32_t* out,
                           int cap, int past) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned all = 0xffffffffu;
  unsigned* key = reinterpret_cast<unsigned*>(score);
  unsigned held[R > 0 ? R : 1];
  if constexpr (R > 0) {
    // Lane l holds keys l R ... l R + R - 1 (16-byte loads where R allows).
    const int mine = allowed - lane * R;  // this lane's keys from here on are not attended
    const auto hold = [&](int j, float x) { held[j] = j < mine ? order_key(x) : 0u; };
    if constexpr (R % 4 == 0) {
#pragma unroll
      for (int j = 0; j < R; j += 4) {
        const float4 x = *reinterpret_cast<const float4*>(score + lane * R + j);
        hold(j, x.x);
        hold(j + 1, x.y);
        hold(j + 2, x.z);
        hold(j + 3, x.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < R; ++j) hold(j, score[lane * R + j]);
    }
    __syncwarp();  // every lane has read its scores before the gathering below overwrites them
  } else {
    for (int c = lane; c < allowed; c += 32) key[c] = order_key(score[c]);
    __syncwarp();
  }
  // f(j, key j of this lane) for every j (key 0, which no pass counts, past `allowed`); fully
  // unrolled over the registers.
  const auto each = [&](auto&& f) {
    if constexpr (R > 0) {
#pragma unroll
      for (int j = 0; j < R; ++j) f(j, held[j]);
    } else {
#pragma unroll 4
      for (int j = 0; j < (allowed + 31) / 32; ++j) {
        const int c = lane + 32 * j;
        f(j, c < allowed ? key[c] : 0u);
      }
    }
  };
  // The warp's count of keys >= x: the keys `each` visits less the borrows of k - x (two
  // instructions a key; the keys past `allowed` are 0, below any x > 0), in two counters (even and
  // odd slices) that halve the dependent chain.
  const int visited = 32 * (R > 0 ? R : (allowed + 31) / 32);
  const auto at_least = [&](unsigned x) {
    unsigned even = 0, odd = 0;  // minus the borrows
    each([&](int j, unsigned k) {
      unsigned& n = R > 0 && j % 2 == 1 ? odd : even;
      asm("{\n .reg .u32 d;\n sub.cc.u32 d, %1, %2;\n subc.u32 %0, %0, 0;\n}"
          : "+r"(n)
          : "r"(k), "r"(x));
    });
    return visited + static_cast<int>(__reduce_add_sync(all, even + odd));
  };
  const auto lanes_before = [&](int x) {  // the sum of x over the lanes below this one
    int sum = x;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int y = __shfl_up_sync(all, sum, d);
      if (lane >= d) sum += y;
    }
    return sum - x;
  };
  const int numbers = at_least(1u);  // NaN's key is 0
  const int keep = min(top_k, numbers);
  unsigned t = ~0u;  // keep = 0: no key is above or equal (valid keys are < 0xffffffff)
  int need = 0;
  if (keep > 0) {
    // Bits of t from the top, with the counts of keys >= t (from_t) and >= t + 2^(bit + 1)
    // (past_t) kept along: the keys in between share t's decided bits. With registers, once they
    // fit one per lane they are gathered and sorted.
    t = 0u;
    int from_t = numbers, past_t = 0, bit = 31;
    if constexpr (R > 0) {
      if (keep <= 32) {
        // t lies between the smallest lane maximum (the 32 lane maxima are keys at least that)
        // and the largest key, so the bits above their highest differing one are t's; no key is
        // >= t + 2^(bit + 1) then, and from_t = numbers stays an upper bound until a pass counts.
        unsigned lane_max = 0u;
#pragma unroll
        for (int j = 0; j < R; ++j) lane_max = max(lane_max, held[j]);
        const unsigned top = __reduce_max_sync(all, lane_max),
                       differ = top ^ __reduce_min_sync(all, lane_max);
        bit = differ == 0u ? -1 : 31 - __clz(differ);
        t = bit < 0 ? top : top & ~((2u << bit) - 1u);
      }
    }
    for (; bit >= 0 && (R == 0 || from_t - past_t > 32); --bit) {
      const int c = at_least(t | (1u << bit));
      if (c >= keep) {
        t |= 1u << bit;
        from_t = c;
      } else {
        past_t = c;
      }
    }
    need = keep - past_t;  // bit < 0: past_t counts the keys above t
    if constexpr (R > 0) {
      if (bit >= 0) {
        // The keys sharing t's decided bits, [t, t + 2^(bit + 1)) less the key 0 (NaN, or not
        // attended): at most 32, at least keep - past_t of them; a mask per lane, then gathered
        // into the scores' place in lane order, one per lane.
        const unsigned lo = max(t, 1u), span = (bit == 31 ? ~0u : (2u << bit) - 1u) - (lo - t);
        unsigned window = 0u;
#pragma unroll
        for (int j = 0; j < R; ++j)
          if (held[j] - lo <= span) window |= 1u << j;
        const int mine = __popc(window);
        int at = lanes_before(mine);
        const int gathered = __shfl_sync(all, at + mine, 31);
#pragma unroll
        for (int j = 0; j < R; ++j)
          if ((window >> j & 1u) != 0u) key[at++] = held[j];
        __syncwarp();
        // Sorted in descending order across the warp (bitonic; lanes past them hold 0), so t is
        // the (keep - past_t)-th.
        unsigned v = lane < gathered ? key[lane] : 0u;
#pragma unroll
        for (int size = 2; size <= 32; size *= 2) {
#pragma unroll
          for (int stride = size / 2; stride > 0; stride /= 2) {
            const unsigned other = __shfl_xor_sync(all, v, stride);
            v = ((lane & stride) == 0) == ((lane & size) == 0) ? max(v, other) : min(v, other);
          }
        }
        t = __shfl_sync(all, v, keep - past_t - 1);
        need = keep - past_t - __popc(__ballot_sync(all, v > t));
      }
    }
  }
  int n = 0;  // blocks written
  if constexpr (R > 0) {
    // Bit j of `taken`: block l R + j chosen. First every key >= t; where that is more than keep,
    // the ties past the first `need` (in block order: the lanes before, then this lane's lower
    // bits) are dropped.
    unsigned taken = 0u;
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (held[j] >= t) taken |= 1u << j;
    if (static_cast<int>(__reduce_add_sync(all, static_cast<unsigned>(__popc(taken)))) > keep) {
      unsigned ties = 0u;
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (held[j] == t) ties |= 1u << j;
      const int mine = __popc(ties), kept = max(0, min(mine, need - lanes_before(mine)));
      for (int drop = mine - kept; drop > 0; --drop) {
        const unsigned last = 1u << (31 - __clz(ties));
        ties &= ~last;
        taken &= ~last;
      }
    }
    if (diagonal >= lane * R && diagonal < lane * R + R) taken |= 1u << (diagonal - lane * R);
    const int chosen = __popc(taken);
    int at = lanes_before(chosen);
    n = __shfl_sync(all, at + chosen, 31);
    for (; taken != 0u; taken &= taken - 1u)
      out[at++] = lane * R + __ffs(static_cast<int>(taken)) - 1;
  } else {
    // The output in block order: lane l's keys are the slice l S ... l S + S - 1 of shared memory,
    // so a block's place is the chosen blocks of the lanes before (a warp scan) plus those before
    // it in its slice; likewise a tie's rank among the ties.
    const int span = (allowed + 31) / 32;
    const auto blocked = [&](auto&& f) {
      for (int c = lane * span; c < min(allowed, (lane + 1) * span); ++c) f(c, key[c]);
    };
    int ties = 0;
    blocked([&](int, unsigned k) { ties += k == t ? 1 : 0; });
    int tie = lanes_before(ties), chosen = 0;
    const auto take = [&](int c, unsigned k) {
      const bool in = k > t || (k == t && tie < need) || c == diagonal;
      tie += k == t ? 1 : 0;
      return in;
    };
    blocked([&](int c, unsigned k) { chosen += take(c, k) ? 1 : 0; });
    int at = lanes_before(chosen);
    n = __shfl_sync(all, at + chosen, 31);
    tie = lanes_before(ties);
    blocked([&](int c, unsigned k) {
      if (take(c, k)) out[at++] = c;
    });
  }
  for (int i = n + lane; i < cap; i += 32) out[i] = past;
}

// A block per (group of `rows` <= 32 consecutive query blocks of one sequence, head), with 8 warps
// per row tile of 16 of them (select_threads): the key-block means are staged once for all its
// rows, so 32 rows a block read half the means from L2 that 16 do. Scores on tensor cores in
// three tf32 products (high x high + high x low + low x high: the float32 dot product up to a few
// ulps): the key-block means staged through shared memory in chunks of 64 (cp.async, the next
// chunk in flight while this one is scored), warp w computing the 16 x 8 tile of row tile w / 8
// and keys 8 (w % 8) ... 8 (w % 8) + 7 of the chunk against the group's query means (rows past
// the group are zero). Then warp w selects rows w, w + warps, ... (select_row). With PDIM (the
// pooled dim) known at compile time, a warp holds its row tile's A fragments in registers for all
// chunks; PDIM = 0 reads them from shared memory at every k-step (any pooled dim).
template <int R, int PDIM>
__global__ void __launch_bounds__(select_threads(kMaxRows), 1)
    select_kernel(const __grid_constant__ select_params p) {
  extern __shared__ float4 shared4[];
  float* shared = reinterpret_cast<float*>(shared4);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int threads = static_cast<int>(blockDim.x),
            tile_rows = threads / 32 / kTileWarps * kTileRows;  // whole row tiles
  const int g = lane / 4, t = lane % 4;            // the MMA fragments' row group and column
  const int tile = warp / kTileWarps * kTileRows;  // the warp's first row
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const int pdim = PDIM > 0 ? PDIM : p.pdim;
  const select_group group = p.groups[blockIdx.x / p.heads];
  const int lq = group.lq, lk = group.lk, stride = row_floats(pdim);
  const int stage_floats = kChunk * stride;
  float* q_hi = shared + kStages * stage_floats;
  float* q_lo = q_hi + tile_rows * pdim;
  float* scores = q_lo + tile_rows * pdim;
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
  const std::int64_t k_stride = std::int64_t{p.heads} * pdim;
  const float* kp = p.pooled_k + (std::int64_t{group.k_base} * p.heads + h) * pdim;
  const int dim4 = pdim / 4;  // 16-byte pieces a row (with PDIM: a constant, so i / dim4 shifts)
  // Thread i copies the pieces i, i + threads, ... of a chunk's rows.
  const auto stage = [&](int c0) {  // commits a group, empty past the last chunk
    float* to = shared + (c0 / kChunk % kStages) * stage_floats;
    const float* from = kp + c0 * k_stride;
    const int n = min(kChunk, most - c0) * dim4;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) {
      const int row = i / dim4, piece = i - row * dim4;
      arch::cp_async_16(arch::shared_address(to + row * stride + 4 * piece),
                        from + row * k_stride + 4 * piece, true);
    }
    arch::cp_async_commit();
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a dependent of the pooling (dependent_launch): the means are complete from here.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // A ring of kStages chunks, kStages - 1 in flight: the staging waited on L2 latency with one.
  // Issued first, so that the key means are on their way while the query means are read.
  for (int i = 0; i < kStages - 1; ++i) stage(i * kChunk);
  // The query means, split into tf32 high and low parts; zero rows past the group.
  const float* qs = p.pooled_q + ((std::int64_t{group.q_base} + group.first) * p.heads + h) * pdim;
  const std::int64_t q_stride = std::int64_t{p.heads} * pdim;
  for (int i = static_cast<int>(threadIdx.x); i < tile_rows * pdim; i += threads) {
    const int row = i / pdim, d = i - row * pdim;
    const float x = row < rows ? qs[row * q_stride + d] : 0.f;
    const float hi = arch::tf32_high(x);
    const int at = query_fragment_index(row, d, pdim);
    q_hi[at] = hi;
    q_lo[at] = x - hi;
  }
  // The row tile's A fragments, k-step by k-step (query_fragment_index): from shared memory, or
  // with PDIM known, once into registers.
  const float4* qh = reinterpret_cast<const float4*>(q_hi) + tile / kTileRows * pdim * 4 + lane;
  const float4* ql = reinterpret_cast<const float4*>(q_lo) + tile / kTileRows * pdim * 4 + lane;
  float4 a_hi[PDIM > 0 ? PDIM / 8 : 1], a_lo[PDIM > 0 ? PDIM / 8 : 1];
  if constexpr (PDIM > 0) {
    __syncthreads();  // the query means are in place
#pragma unroll
    for (int s = 0; s < PDIM / 8; ++s) {
      a_hi[s] = qh[32 * s];
      a_lo[s] = ql[32 * s];
    }
  }
  const int allowed_lo = allowed_of(tile + g), allowed_hi = allowed_of(tile + g + 8);
  for (int c0 = 0; c0 < most; c0 += kChunk) {
    arch::cp_async_wait<kStages - 2>();  // this thread's copies of chunk c0 have landed
    // Every thread's copies have landed and every thread is done with the chunk before (and,
    // first, the query means are in place): its stage takes the chunk kStages - 1 ahead.
    __syncthreads();
    stage(c0 + (kStages - 1) * kChunk);
    const int column = 8 * (warp % kTileWarps), c = c0 + column;  // the warp's first key block
    if (c < most && tile < rows) {
      // B: key block c + g (rows past the chunk hold stale values whose scores are not stored).
      const float* key = shared + (c0 / kChunk % kStages) * stage_floats + (column + g) * stride;
      float acc[4] = {}, acc_hl[4] = {}, acc_lh[4] = {};  // three independent MMA chains
      // One k-step: A's high and low parts, B's two values (dims t and t + 4 of the step).
      const auto step = [&](float4 hi, float4 lo, float k_0, float k_1) {
        const std::uint32_t a_h[4] = {__float_as_uint(hi.x), __float_as_uint(hi.y),
                                      __float_as_uint(hi.z), __float_as_uint(hi.w)};
        const std::uint32_t a_l[4] = {__float_as_uint(lo.x), __float_as_uint(lo.y),
                                      __float_as_uint(lo.z), __float_as_uint(lo.w)};
        const float h_0 = arch::tf32_high(k_0), h_1 = arch::tf32_high(k_1);
        const std::uint32_t b_hi[2] = {__float_as_uint(h_0), __float_as_uint(h_1)};
        const std::uint32_t b_lo[2] = {__float_as_uint(k_0 - h_0), __float_as_uint(k_1 - h_1)};
        arch::mma_16x8x8_f32_tf32(acc_lh, a_l, b_hi);
        arch::mma_16x8x8_f32_tf32(acc_hl, a_h, b_lo);
        arch::mma_16x8x8_f32_tf32(acc, a_h, b_hi);
      };
      // Two k-steps per 16 dims: the key's x, y are the first step's values, z, w the second's
      // (pooled_position).
#pragma unroll 4
      for (int j = 0; j < pdim; j += 16) {
        const float4 kv = *reinterpret_cast<const float4*>(key + j + 4 * t);
        const int s = j / 8;  // the first step
        if constexpr (PDIM > 0) {
          step(a_hi[s], a_lo[s], kv.x, kv.y);
          step(a_hi[s + 1], a_lo[s + 1], kv.z, kv.w);
        } else {
          step(qh[32 * s], ql[32 * s], kv.x, kv.y);
          step(qh[32 * s + 32], ql[32 * s + 32], kv.z, kv.w);
        }
      }
      for (int e = 0; e < 4; ++e) acc[e] += acc_hl[e] + acc_lh[e];
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
  for (int i = warp; i < rows; i += threads / 32) {
    const int r = group.first + i, allowed = allowed_of(i);
    float* score = scores + i * score_stride;
    // The block holding the key aligned with the query block's last row (< allowed).
    const int aligned = min(lq, (r + 1) * p.block) - 1 + lk - lq;
    const int diagonal =
        p.keep_diagonal && aligned >= 0 && lk > 0 ? in_blocks(min(aligned, lk - 1)) : -1;
    select_row<R>(
        score, allowed, p.top_k, diagonal,
        p.col_idx + (std::int64_t{group.q_base} * p.heads + std::int64_t{h} * nbq + r) * p.cap,
        p.cap, nbk);
  }
}

// The selection kernel holding R keys per lane in registers: the fewest that cover max_k_blocks,
// up to 32 (1024 key blocks); beyond, R = 0 (keys read from shared memory in every pass). The
// A fragments in registers where the pooled dim is 64 (head dims 49-64); other dims read them
// from shared memory.
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
  int device = 0, limit = 0, sms = 0, major = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TRISPARSE_CUDA_TRY(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  t->held = held_keys(t->max_k_blocks);
  for (int rows = kMaxRows; rows >= 1 && t->rows == 0; rows /= 2)
    if (select_floats(rows, t->pdim, score_floats(t->held, t->max_k_blocks)) * 4 <= limit)
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
  // Blocks of 32 rows (16 warps, most of an SM's shared memory) cannot sit beside a full SM of
  // pooling blocks: launched as dependents (sm_90), they take an SM as the pooling leaves it and
  // start before it ends. Smaller blocks would be placed early and take the room of the pooling's
  // second wave (measured slower, docs/notes/block_sparse.md), so they wait in stream order.
  t->dependent_launch = major >= 9 && t->rows == kMaxRows;
  TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(
      select_kernel_for(t->held, t->pdim), cudaFuncAttributeMaxDynamicSharedMemorySize,
      select_floats(t->rows, t->pdim, score_floats(t->held, t->max_k_blocks)) * 4));
  t->num_groups = static_cast<std::int32_t>(groups.size());
  t->groups = device_buffer<select_group>(groups);
  q_blocks.insert(q_blocks.end(), k_blocks.begin(), k_blocks.end());
  t->pool_blocks = device_buffer<pool_block>(q_blocks);
  // The pooling's persistent warps: as many blocks as fit at once, or one per kPoolThreads / 32
  // tasks where fewer.
  int pool_per_sm = 0;
  TRISPARSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &pool_per_sm, pool_kernel<__half>, kPoolThreads, 0));
  const std::int64_t pool_tasks = std::int64_t{t->q_blocks + t->k_blocks} * t->heads;
  t->pool_grid = static_cast<unsigned>(
      std::min<std::int64_t>((pool_tasks + kPoolThreads / 32 - 1) / (kPoolThreads / 32),
                             std::int64_t{std::max(1, pool_per_sm)} * sms));
  t->pooled_q = device_buffer<float>(static_cast<std::size_t>(t->q_blocks) * t->heads * t->pdim);
  t->pooled_k = device_buffer<float>(static_cast<std::size_t>(t->k_blocks) * t->heads * t->pdim);
  // The padding dims (pdim > dim) stay zero: the pooling writes only the first dim. Done before
  // the plan is returned, whatever stream select() runs on later.
  for (auto* pooled : {&t->pooled_q, &t->pooled_k}) {
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(pooled->data(), 0, pooled->size() * sizeof(float),
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
    pool_kernel<__half><<<t.pool_grid, kPoolThreads, 0, s>>>(pp);
  else
    pool_kernel<__nv_bfloat16><<<t.pool_grid, kPoolThreads, 0, s>>>(pp);
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
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(select_threads(t.rows)));
  config.dynamicSmemBytes = static_cast<std::size_t>(
      select_floats(t.rows, t.pdim, score_floats(t.held, t.max_k_blocks)) * 4);
  config.stream = s;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &dependent;
  config.numAttrs = t.dependent_launch ? 1 : 0;
  TRISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, select_kernel_for(t.held, t.pdim), sp));
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
