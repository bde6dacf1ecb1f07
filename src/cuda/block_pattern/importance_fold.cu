// A pattern learner's tracked step on the device (importance_fold.hpp): small kernels on the
// caller's stream, no floating-point atomics (each sum in a fixed order: the same bits on every
// run).
// - block_means: one thread block per (block, head), a thread per feature: the query blocks'
//   means as [H][qb][D] and the key blocks' transposed, [H][D][kb], so that the scores kernel's
//   threads (one per key block) read them coalesced;
// - pooled_scores: kRows block rows of one head a thread block, their means in shared memory;
//   each thread scores its key blocks against all kRows rows, then a warp per row turns the
//   scores into the softmax in place (the row is in L2: it was just written);
// - fold: a warp per (head, block row): the pooled total over the kept blocks, then the new
//   importance folded into the average;
// - prune_top: a thread block per row (or head): a radix select of the `budget`-th highest
//   ranking key, 8 bits a pass (counts in shared memory; no more passes once every key matching
//   the bits chosen is to be kept), then keep written in index order, ties at the threshold to
//   the lowest indices (a ballot scan);
// - prune_chunk: the same for a long head's global prune over its chunks, ten launches: each
//   pass's counts summed over the chunks in the workspace (64-bit integer atomics: the same sums
//   in any order), the keys at the threshold a chunk, then the marking.
// Each kernel reads the caller's `due` flag first and returns at once where it is false.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../common/current_device.cuh"
#include "../common/dispatch.cuh"
#include "../common/error.cuh"
#include "importance_fold.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kMeanThreads = 64;           // features a pass of block_means
constexpr int kRows = 16;                  // block rows a thread block of pooled_scores
constexpr int kScoreThreads = 256;         // pooled_scores' threads at most (a key block each)
constexpr int kLoads = 8;                  // key features a thread of pooled_scores loads at once
constexpr int kFoldWarps = 8;              // block rows a thread block of fold
constexpr int kPruneRowThreads = 256;      // prune_top's threads for a row
constexpr int kPruneGlobalThreads = 1024;  // and for a head
constexpr int kPruneChunkThreads = 512;    // and for a chunk of a long head

__device__ __forceinline__ bool not_due(const bool* due) { return due != nullptr && !*due; }

__device__ __forceinline__ double as_double(__half x) { return __half2float(x); }
__device__ __forceinline__ double as_double(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double as_double(float x) { return x; }
__device__ __forceinline__ double as_double(double x) { return x; }

__device__ __forceinline__ double warp_sum(double x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;  // (a butterfly: every lane the same bits)
}
__device__ __forceinline__ double warp_max(double x) {
  for (int o = 16; o > 0; o /= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// blockIdx.x < qb: query block blockIdx.x, else key block blockIdx.x - qb; blockIdx.y the head.
template <class T>
__global__ void __launch_bounds__(kMeanThreads)
    block_means(tensor_view q, tensor_view k, int g, int qb, int kb, double* __restrict__ qm,
                double* __restrict__ km_t, const bool* due) {
  if (not_due(due)) return;
  const bool is_q = static_cast<int>(blockIdx.x) < qb;
  const tensor_view& x = is_q ? q : k;
  const int b = is_q ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) - qb;
  const int h = static_cast<int>(blockIdx.y), d = static_cast<int>(x.dim);
  const std::int64_t first = static_cast<std::int64_t>(b) * g;
  const int rows = static_cast<int>(::min(static_cast<std::int64_t>(g), x.rows - first));
  const T* base = static_cast<const T*>(x.data) + first * x.row_stride + h * x.head_stride;
  for (int j = static_cast<int>(threadIdx.x); j < d; j += kMeanThreads) {
    double sum = 0.0;
    for (int i = 0; i < rows; ++i) sum += as_double(base[i * x.row_stride + j]);
    const double mean = sum / rows;
    if (is_q)
      qm[(static_cast<std::int64_t>(h) * qb + b) * d + j] = mean;
    else
      km_t[(static_cast<std::int64_t>(h) * d + j) * kb + b] = mean;
  }
}

struct score_args {
  const double* qm;    // [H][qb][D]
  const double* km_t;  // [H][D][kb]
  double* out;         // [H][qb][kb]
  int qb, kb, d, g;
  std::int64_t n_q, n_k;
  bool causal;
  double scale;
  const bool* due;
};

__global__ void __launch_bounds__(kScoreThreads) pooled_scores(score_args a) {
  extern __shared__ double rows_q[];  // [kRows][D]
  if (not_due(a.due)) return;
  const int h = static_cast<int>(blockIdx.y), r0 = static_cast<int>(blockIdx.x) * kRows;
  const int rows = min(kRows, a.qb - r0);
  for (int i = static_cast<int>(threadIdx.x); i < kRows * a.d; i += static_cast<int>(blockDim.x)) {
    const int r = i / a.d;
    rows_q[i] =
        r < rows ? a.qm[(static_cast<std::int64_t>(h) * a.qb + r0 + r) * a.d + i % a.d] : 0.0;
  }
  __syncthreads();
  const double minus_inf = -CUDART_INF;
  double* out = a.out + (static_cast<std::int64_t>(h) * a.qb + r0) * a.kb;
  const int threads = static_cast<int>(blockDim.x);
  for (int c = static_cast<int>(threadIdx.x); c < a.kb; c += threads) {
    double dot[kRows] = {};
    const double* key = a.km_t + static_cast<std::int64_t>(h) * a.d * a.kb + c;
    int j = 0;
    for (; j + kLoads <= a.d; j += kLoads) {  // kLoads key features in flight, then their FMAs
      double kv[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) kv[u] = key[static_cast<std::int64_t>(j + u) * a.kb];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) dot[r] += rows_q[r * a.d + j + u] * kv[u];
      }
    }
    for (; j < a.d; ++j) {  // (each sum in feature order either way: the same bits)
      const double kv = key[static_cast<std::int64_t>(j) * a.kb];
#pragma unroll
      for (int r = 0; r < kRows; ++r) dot[r] += rows_q[r * a.d + j] * kv;
    }
    const std::int64_t first_key = static_cast<std::int64_t>(c) * a.g;
    const double log_keys =
        log(static_cast<double>(::min(static_cast<std::int64_t>(a.g), a.n_k - first_key)));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;
      // The last key the block row's last query sees (causal, aligned at the bottom right).
      const std::int64_t last =
          ::min(static_cast<std::int64_t>(r0 + r + 1) * a.g, a.n_q) - 1 + a.n_k - a.n_q;
      out[static_cast<std::int64_t>(r) * a.kb + c] =
          a.causal && first_key > last ? minus_inf : a.scale * dot[r] + log_keys;
    }
  }
  __syncthreads();  // (the block's global writes are visible to its threads past the barrier)
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  for (int r = warp; r < rows; r += threads / 32) {
    double* row = out + static_cast<std::int64_t>(r) * a.kb;
    double top = minus_inf;
    for (int c = lane; c < a.kb; c += 32) top = fmax(top, row[c]);
    top = warp_max(top);
    if (top == minus_inf) {  // no key block: zeros
      for (int c = lane; c < a.kb; c += 32) row[c] = 0.0;
      continue;
    }
    double sum = 0.0;
    for (int c = lane; c < a.kb; c += 32) sum += exp(row[c] - top);
    sum = warp_sum(sum);
    for (int c = lane; c < a.kb; c += 32) row[c] = exp(row[c] - top) / sum;
  }
}

__global__ void __launch_bounds__(kFoldWarps * 32) fold(importance_fold_args a) {
  if (not_due(a.due)) return;
  const std::int64_t line =
      static_cast<std::int64_t>(blockIdx.x) * kFoldWarps + static_cast<int>(threadIdx.x) / 32;
  if (line >= a.heads * a.qb) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t h = line / a.qb, r = line % a.qb, base = line * a.kb;
  double kept = 0.0;
  for (std::int64_t c = lane; c < a.kb; c += 32)
    if (a.keep[base + c]) kept += a.pooled[base + c];
  kept = warp_sum(kept);
  const bool seen = a.seen == nullptr || a.seen[r];
  const float* mass = a.mass + h * a.mass_strides[1] + r * a.mass_strides[2];
  for (std::int64_t c = lane; c < a.kb; c += 32) {
    double fresh = a.pooled[base + c];
    if (a.keep[base + c]) {
      double m = 0.0;
      for (std::int64_t b = 0; b < a.batch; ++b)
        m += mass[b * a.mass_strides[0] + c * a.mass_strides[3]];
      fresh = m / static_cast<double>(a.batch) * kept;
    }
    const double s = a.state[base + c];
    a.state[base + c] = seen ? s * a.decay + (1.0 - a.decay) * fresh : fresh;
  }
}

__global__ void schedule(learner_schedule_args a) {
  const std::int64_t s = *a.steps;
  const learner_flags f = schedule_flags(s, a.warmup, a.every, a.track_every, a.freeze_after);
  a.flags[0] = f.prune;
  a.flags[1] = f.fold;
  a.flags[2] = f.track;
  *a.steps = s + 1;
}

// A radix select's state before a pass: the key bits chosen so far (`prefix` at the bits of
// `fixed`), the keys still to take among those matching them, and how many keys match them.
// Done when every matching key is to be taken (the later passes would change nothing).
struct radix_state {
  std::uint64_t prefix = 0, fixed = 0;
  std::int64_t need = 0;
  std::int64_t at_digit = 0;
  __device__ bool done() const { return fixed != 0 && need == at_digit; }
};

// The state after the pass at `shift`, from the counts of that digit among the keys matching
// s.prefix (count(d), d < 256): the highest digit with at least s.need keys at or above it.
// The whole thread block calls it (at least 256 threads); `scan`: 256 words of shared memory.
template <class Count>
__device__ radix_state select_digit(Count count, radix_state s, int shift, std::int64_t* scan) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < 256) scan[t] = static_cast<std::int64_t>(count(255 - t));  // digits high to low
  __syncthreads();
  for (int o = 1; o < 256; o *= 2) {  // scan[t]: the keys of the t + 1 highest digits
    const std::int64_t add = t < 256 && t >= o ? scan[t - o] : 0;
    __syncthreads();
    if (t < 256) scan[t] += add;
    __syncthreads();
  }
  const int higher = ::min(__syncthreads_count(t < 256 && scan[t] < s.need), 255);
  const std::int64_t above = higher > 0 ? scan[higher - 1] : 0;
  radix_state next;
  next.prefix = s.prefix | static_cast<std::uint64_t>(255 - higher) << shift;
  next.fixed = s.fixed | std::uint64_t{255} << shift;
  next.need = s.need - above;
  next.at_digit = scan[higher] - above;
  __syncthreads();  // (scan is read before the next call writes it)
  return next;
}

// The ranking key of block i of the row or head at `base` (forced ones first), and whether it
// is forced.
struct prune_keys {
  const block_prune_args& a;
  std::int64_t base, forced0;
  __device__ bool forced(std::int64_t i) const {
    return a.forced != nullptr && a.forced[forced0 + i];
  }
  __device__ std::uint64_t key(std::int64_t i) const {
    return forced(i) ? prune_rank_key(CUDART_INF) : prune_rank_key(a.importance[base + i]);
  }
};

// keep over [begin, end) of a row or head: forced, above the threshold, or among the first
// `need` keys at it counting the `ties_before` ones before `begin` (a ballot scan; every key at
// it where the select is done, compared on its fixed bits).
template <int kThreads>
__device__ void mark_kept(const prune_keys& keys, std::int64_t begin, std::int64_t end,
                          radix_state s, std::int64_t ties_before, int* warp_ties) {
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
  const bool all_ties = s.need >= s.at_digit;
  for (std::int64_t i0 = begin; i0 < end; i0 += kThreads) {
    const std::int64_t i = i0 + t;
    const std::uint64_t k = i < end ? keys.key(i) & s.fixed : 0;
    const bool tie = i < end && k == s.prefix;
    if (all_ties) {  // (every key at the threshold kept: no order needed)
      if (i < end) keys.a.keep[keys.base + i] = keys.forced(i) || k >= s.prefix;
      continue;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) warp_ties[warp] = __popc(ballot);
    __syncthreads();
    std::int64_t rank = ties_before + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) rank += warp_ties[w];
    if (i < end) {
      keys.a.keep[keys.base + i] = keys.forced(i) || k > s.prefix || (tie && rank < s.need);
    }
    for (int w = 0; w < kThreads / 32; ++w) ties_before += warp_ties[w];
    __syncthreads();
  }
}

// blockIdx.x: a row (h * qb + r) of kb blocks, or (GLOBAL) a head of qb * kb.
template <bool GLOBAL>
__global__ void __launch_bounds__(GLOBAL ? kPruneGlobalThreads : kPruneRowThreads)
    prune_top(block_prune_args a) {
  constexpr int kThreads = GLOBAL ? kPruneGlobalThreads : kPruneRowThreads;
  __shared__ unsigned counts[256];
  __shared__ std::int64_t scan[256];
  __shared__ int warp_ties[kThreads / 32];
  if (not_due(a.due)) return;
  const std::int64_t length = GLOBAL ? a.qb * a.kb : a.kb;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * length;
  const prune_keys keys{a, base, GLOBAL ? 0 : static_cast<std::int64_t>(blockIdx.x) % a.qb * a.kb};
  const int t = static_cast<int>(threadIdx.x);
  // The threshold: the highest key with at least `budget` keys at or above it, 8 bits a pass.
  radix_state s;
  s.need = ::min(a.budget, length);
  for (int shift = 56; shift >= 0 && !s.done(); shift -= 8) {
    for (int d = t; d < 256; d += kThreads) counts[d] = 0;
    __syncthreads();
    for (std::int64_t i = t; i < length; i += kThreads) {
      const std::uint64_t k = keys.key(i);
      if ((k & s.fixed) == s.prefix) atomicAdd(&counts[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    s = select_digit([&](int d) { return counts[d]; }, s, shift, scan);
  }
  mark_kept<kThreads>(keys, 0, length, s, 0, warp_ties);
}

// The sum of the threads' `mine` over the thread block, through `total` in shared memory
// (integer atomics: the same sum in any order).
__device__ std::int64_t block_sum(std::int64_t mine, std::int64_t* total) {
  if (threadIdx.x == 0) *total = 0;
  __syncthreads();
  if (mine != 0) atomicAdd(reinterpret_cast<unsigned long long*>(total), mine);
  __syncthreads();
  return *total;
}

// The global prune of long heads, a chunk of kPruneChunkKeys blocks a thread block: 8 counting
// passes, then the ties a chunk and the marking, each a launch over every head's chunks.
struct chunk_ws {
  std::uint64_t* counts;  // [heads][8][256]: the keys of each digit matching the pass's prefix
  radix_state* state;     // [heads][8]: the state before each pass (1-7)
  std::int64_t* ties;     // [heads][chunks]: keys at the threshold in each chunk
  std::int64_t chunks;
};

// The state before `pass` (0-8) of head h: pass 0 from the budget, later ones from the counts
// and state of the pass before (as it was where that was done); chunk 0 writes it for the next
// pass to read.
__device__ radix_state chunk_state(const block_prune_args& a, const chunk_ws& w, std::int64_t h,
                                   int pass, std::int64_t* scan) {
  radix_state s;
  s.need = ::min(a.budget, a.qb * a.kb);
  if (pass == 0) return s;
  if (pass > 1) s = w.state[h * 8 + pass - 1];
  if (!s.done()) {
    const std::uint64_t* counts = w.counts + (h * 8 + pass - 1) * 256;
    s = select_digit([&](int d) { return counts[d]; }, s, 64 - 8 * pass, scan);
  }
  if (pass < 8 && blockIdx.x % w.chunks == 0 && threadIdx.x == 0) w.state[h * 8 + pass] = s;
  return s;
}

// pass 0-7: count the digit at 56 - 8 pass of the chunk's keys matching the prefix.
// pass 8: count the chunk's keys at the threshold. pass 9: mark the chunk's blocks.
__global__ void __launch_bounds__(kPruneChunkThreads)
    prune_chunk(block_prune_args a, chunk_ws w, int pass) {
  constexpr int kThreads = kPruneChunkThreads;
  __shared__ unsigned counts[256];
  __shared__ std::int64_t scan[256];
  __shared__ std::int64_t total;
  __shared__ int warp_ties[kThreads / 32];
  if (not_due(a.due)) return;
  const std::int64_t h = blockIdx.x / w.chunks, chunk = blockIdx.x % w.chunks;
  const std::int64_t length = a.qb * a.kb;
  const std::int64_t begin = chunk * kPruneChunkKeys;
  const std::int64_t end = ::min(begin + kPruneChunkKeys, length);
  const prune_keys keys{a, h * length, 0};
  const int t = static_cast<int>(threadIdx.x), lane = t % 32;
  const radix_state s = chunk_state(a, w, h, ::min(pass, 8), scan);
  if (pass == 9) {
    std::int64_t before = 0;
    if (s.need < s.at_digit) {  // ties to rank: those of the chunks before this one
      std::int64_t mine = 0;
      for (std::int64_t c = t; c < chunk; c += kThreads) mine += w.ties[h * w.chunks + c];
      before = block_sum(mine, &total);
    }
    mark_kept<kThreads>(keys, begin, end, s, before, warp_ties);
    return;
  }
  if (pass == 8) {
    if (s.need >= s.at_digit) return;  // (every tie kept, or done: the marking needs no ranks)
    std::int64_t mine = 0;
    for (std::int64_t i = begin + t; i < end; i += kThreads) mine += keys.key(i) == s.prefix;
    const std::int64_t ties = block_sum(mine, &total);
    if (t == 0) w.ties[h * w.chunks + chunk] = ties;
    return;
  }
  if (s.done()) return;  // (an earlier pass settled every key)
  const int shift = 56 - 8 * pass;
  for (int d = t; d < 256; d += kThreads) counts[d] = 0;
  __syncthreads();
  for (std::int64_t i0 = begin; i0 < end; i0 += kThreads) {  // (whole warps: the match below)
    const std::int64_t i = i0 + t;
    int digit = 256;  // (none)
    if (i < end) {
      const std::uint64_t k = keys.key(i);
      if ((k & s.fixed) == s.prefix) digit = static_cast<int>((k >> shift) & 255u);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, digit);  // one add a warp and digit
    if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&counts[digit], __popc(peers));
  }
  __syncthreads();
  for (int d = t; d < 256; d += kThreads) {
    if (counts[d] != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&w.counts[(h * 8 + pass) * 256 + d]),
                static_cast<unsigned long long>(counts[d]));
    }
  }
}

}  // namespace

void pooled_block_mass(const tensor_view& q, const tensor_view& k, std::int64_t block, bool causal,
                       double scale, double* out, double* means, const bool* due,
                       stream_ref stream) {
  expect_current_device(q.device_id, "pooled_block_mass: q");
  TRISPARSE_EXPECTS_INPUT(q.type == k.type, "pooled_block_mass: q and k must have one dtype");
  const int g = static_cast<int>(block), d = static_cast<int>(q.dim);
  const int qb = static_cast<int>((q.rows + block - 1) / block);
  const int kb = static_cast<int>((k.rows + block - 1) / block);
  const int heads = static_cast<int>(q.heads);
  auto s = static_cast<cudaStream_t>(stream.handle);
  double* qm = means;
  double* km_t = means + static_cast<std::int64_t>(heads) * qb * d;
  const dim3 mean_grid(static_cast<unsigned>(qb + kb), static_cast<unsigned>(heads));
  const auto launch = [&]<class T>() {
    block_means<T><<<mean_grid, kMeanThreads, 0, s>>>(q, k, g, qb, kb, qm, km_t, due);
  };
  if (q.type == dtype::f64)  // (a dtype the attention kernels do not take; the means read it)
    launch.template operator()<double>();
  else
    with_element_type(q.type, "pooled_block_mass", launch);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  const std::size_t shared = sizeof(double) * kRows * static_cast<std::size_t>(d);
  if (shared > 48 * 1024) {
    TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(
        pooled_scores, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  }
  const score_args a{qm, km_t, out, qb, kb, d, g, q.rows, k.rows, causal, scale, due};
  const dim3 grid(static_cast<unsigned>((qb + kRows - 1) / kRows), static_cast<unsigned>(heads));
  const int threads = std::max(32, std::min(kScoreThreads, (kb + 31) / 32 * 32));  // none idle
  pooled_scores<<<grid, threads, shared, s>>>(a);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

void fold_block_importance(const importance_fold_args& args, stream_ref stream) {
  expect_current_device(args.device_id, "fold_block_importance: state");
  const std::int64_t lines = args.heads * args.qb;
  const auto blocks = static_cast<unsigned>((lines + kFoldWarps - 1) / kFoldWarps);
  fold<<<blocks, kFoldWarps * 32, 0, static_cast<cudaStream_t>(stream.handle)>>>(args);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

void advance_learner_schedule(const learner_schedule_args& args, stream_ref stream) {
  expect_current_device(args.device_id, "advance_learner_schedule: steps");
  schedule<<<1, 1, 0, static_cast<cudaStream_t>(stream.handle)>>>(args);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

void prune_block_importance(const block_prune_args& args, stream_ref stream) {
  expect_current_device(args.device_id, "prune_block_importance: keep");
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t chunks = prune_chunks(args.qb, args.kb, args.scope);
  if (chunks > 0) {
    auto* words = static_cast<std::uint64_t*>(args.workspace);
    static_assert(sizeof(radix_state) == 4 * sizeof(std::uint64_t));
    const chunk_ws w{words, reinterpret_cast<radix_state*>(words + args.heads * 8 * 256),
                     reinterpret_cast<std::int64_t*>(words + args.heads * (8 * 256 + 32)), chunks};
    TRISPARSE_CUDA_TRY(
        cudaMemsetAsync(w.counts, 0, sizeof(std::uint64_t) * args.heads * 8 * 256, s));
    const auto grid = static_cast<unsigned>(args.heads * chunks);
    for (int pass = 0; pass < 10; ++pass) {
      prune_chunk<<<grid, kPruneChunkThreads, 0, s>>>(args, w, pass);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
  } else if (args.scope == prune_scope::global) {
    prune_top<true><<<static_cast<unsigned>(args.heads), kPruneGlobalThreads, 0, s>>>(args);
  } else {
    const auto rows = static_cast<unsigned>(args.heads * args.qb);
    prune_top<false><<<rows, kPruneRowThreads, 0, s>>>(args);
  }
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace trisparse::cuda
