// A pattern learner's tracked step on the device (importance_fold.hpp): three small kernels on
// the caller's stream, no atomics (each sum in a fixed order: the same bits on every run).
// - block_means: one thread block per (block, head), a thread per feature: the query blocks'
//   means as [H][qb][D] and the key blocks' transposed, [H][D][kb], so that the scores kernel's
//   threads (one per key block) read them coalesced;
// - pooled_scores: kRows block rows of one head a thread block, their means in shared memory;
//   each thread scores its key blocks against all kRows rows, then a warp per row turns the
//   scores into the softmax in place (the row is in L2: it was just written);
// - fold: a warp per (head, block row): the pooled total over the kept blocks, then the new
//   importance folded into the average;
// - prune_top: a thread block per row (or head): a radix select of the `budget`-th highest
//   ranking key, 8 bits a pass (counts in shared memory), then keep written in index order, ties
//   at the threshold to the lowest indices (a ballot scan).
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

// blockIdx.x: a row (h * qb + r) of kb blocks, or (GLOBAL) a head of qb * kb.
template <bool GLOBAL>
__global__ void __launch_bounds__(GLOBAL ? kPruneGlobalThreads : kPruneRowThreads)
    prune_top(block_prune_args a) {
  constexpr int kThreads = GLOBAL ? kPruneGlobalThreads : kPruneRowThreads;
  __shared__ unsigned counts[256];
  __shared__ std::uint64_t chosen;
  __shared__ std::int64_t left;
  __shared__ int warp_ties[kThreads / 32];
  if (not_due(a.due)) return;
  const std::int64_t length = GLOBAL ? a.qb * a.kb : a.kb;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * length;
  const std::int64_t forced0 = GLOBAL ? 0 : static_cast<std::int64_t>(blockIdx.x) % a.qb * a.kb;
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
  const std::uint64_t forced_key = prune_rank_key(CUDART_INF);
  const auto forced = [&](std::int64_t i) { return a.forced != nullptr && a.forced[forced0 + i]; };
  const auto key = [&](std::int64_t i) {
    return forced(i) ? forced_key : prune_rank_key(a.importance[base + i]);
  };
  // The threshold: the highest key with at least `budget` keys at or above it, 8 bits a pass.
  std::uint64_t prefix = 0, fixed = 0;
  std::int64_t need = ::min(a.budget, length);  // keys still to choose at the threshold
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int d = t; d < 256; d += kThreads) counts[d] = 0;
    __syncthreads();
    for (std::int64_t i = t; i < length; i += kThreads) {
      const std::uint64_t k = key(i);
      if ((k & fixed) == prefix) atomicAdd(&counts[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (t == 0) {
      std::int64_t above = 0;
      int digit = 255;
      for (; digit > 0 && above + counts[digit] < need; --digit) above += counts[digit];
      chosen = prefix | (static_cast<std::uint64_t>(digit) << shift);
      left = need - above;
    }
    __syncthreads();
    prefix = chosen;
    need = left;
    fixed |= 255ull << shift;
  }
  // Keys above the threshold, the forced blocks, and the first `need` keys at it.
  std::int64_t ties_before = 0;
  for (std::int64_t i0 = 0; i0 < length; i0 += kThreads) {
    const std::int64_t i = i0 + t;
    const std::uint64_t k = i < length ? key(i) : 0;
    const bool tie = i < length && k == prefix;
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) warp_ties[warp] = __popc(ballot);
    __syncthreads();
    std::int64_t rank = ties_before + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) rank += warp_ties[w];
    if (i < length) a.keep[base + i] = forced(i) || k > prefix || (tie && rank < need);
    for (int w = 0; w < kThreads / 32; ++w) ties_before += warp_ties[w];
    __syncthreads();
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
  if (args.scope == prune_scope::global) {
    prune_top<true><<<static_cast<unsigned>(args.heads), kPruneGlobalThreads, 0, s>>>(args);
  } else {
    const auto rows = static_cast<unsigned>(args.heads * args.qb);
    prune_top<false><<<rows, kPruneRowThreads, 0, s>>>(args);
  }
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace trisparse::cuda
