// Block masks written on the device (device_plan.cuh): the lists of a mask given as bytes on the
// device, and the transposed lists of any plan whose blocks the device writes (a top-k
// selection). Each list is built by one warp, which walks its line (a block row, or a key block's
// column) 32 entries at a time and ballots the kept ones: the counts, their prefix sums per mask
// (one thread block per mask), then the ascending lists. No atomics, so the lists are the same
// on every run; no host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>

#include "../../common/error.cuh"
#include "device_plan.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kWarps = 8;          // lines a thread block of the count and fill kernels
constexpr int kScanThreads = 256;  // the prefix sums' threads (one block per mask)

// Whether the ascending list [first, last) holds c.
__device__ __forceinline__ bool holds(const std::int32_t* __restrict__ list, std::int32_t first,
                                      std::int32_t last, std::int32_t c) {
  while (first < last) {
    const std::int32_t mid = first + (last - first) / 2;
    const std::int32_t x = list[mid];
    if (x == c) return true;
    if (x < c)
      first = mid + 1;
    else
      last = mid;
  }
  return false;
}

// One warp per line of every mask: with COUNT, writes the line's kept entries at
// offsets[line + 1] (the prefix sums follow); else writes their indices, ascending, from
// offsets[line]. ROWS: lines are block rows and `kept` tells the entries; else lines are key
// blocks and the plan's row lists tell them (query block r holds key block c).
template <bool ROWS, bool COUNT>
__global__ void __launch_bounds__(kWarps * 32)
    walk_lines(const mask_extent* __restrict__ extents, int masks, device_kept kept,
               const std::int32_t* __restrict__ row_ptr, const std::int32_t* __restrict__ col_idx,
               std::int32_t* __restrict__ offsets, std::int32_t* __restrict__ lists,
               const bool* due) {
  if (due != nullptr && !*due) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int line = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
  for (int m = static_cast<int>(blockIdx.y); m < masks; m += static_cast<int>(gridDim.y)) {
    const mask_extent e = extents[m];
    const int lines = ROWS ? e.rows : e.cols, other = ROWS ? e.cols : e.rows;
    if (line >= lines) continue;
    std::int32_t* at = offsets + (ROWS ? e.row0 : e.col0) + line;
    std::int32_t n = COUNT ? 0 : at[0];
    for (int x0 = 0; x0 < other; x0 += 32) {
      const int x = x0 + lane;
      bool in = false;
      if (x < other) {
        if constexpr (ROWS) {
          in = kept.data[e.kept + static_cast<std::int64_t>(line) * kept.row_stride + x] != 0;
        } else {
          in = holds(col_idx, row_ptr[e.row0 + x], row_ptr[e.row0 + x + 1], line);
        }
      }
      const unsigned bits = __ballot_sync(0xffffffffu, in);
      if (!COUNT && in) lists[n + __popc(bits & ((1u << lane) - 1u))] = x;
      n += __popc(bits);
    }
    if (COUNT && lane == 0) at[1] = n;
  }
}

// One thread block per mask: offsets[first + 1 .. first + n] hold the lines' counts; they become
// base + the inclusive sums, and offsets[first] = base. Each thread sums a run of lines, the runs'
// sums are scanned in shared memory, then each thread writes its run.
template <bool ROWS>
__global__ void __launch_bounds__(kScanThreads)
    scan_lines(const mask_extent* __restrict__ extents, std::int32_t* __restrict__ offsets,
               const bool* due) {
  __shared__ std::int32_t sums[kScanThreads];
  if (due != nullptr && !*due) return;
  const mask_extent e = extents[blockIdx.x];
  const int n = ROWS ? e.rows : e.cols;
  std::int32_t* o = offsets + (ROWS ? e.row0 : e.col0);
  const int t = static_cast<int>(threadIdx.x);
  const int run = (n + kScanThreads - 1) / kScanThreads;
  const int first = min(n, t * run), last = min(n, first + run);
  std::int32_t sum = 0;
  for (int i = first; i < last; ++i) sum += o[i + 1];
  sums[t] = sum;
  __syncthreads();
  if (t == 0) {
    std::int32_t acc = e.base;
    for (int i = 0; i < kScanThreads; ++i) {
      const std::int32_t x = sums[i];
      sums[i] = acc;
      acc += x;
    }
    o[0] = e.base;
  }
  __syncthreads();
  std::int32_t acc = sums[t];
  for (int i = first; i < last; ++i) {
    acc += o[i + 1];
    o[i + 1] = acc;
  }
}

template <bool ROWS>
void build_lists(block_sparse_device_plan& plan, const device_kept& kept, std::int32_t* offsets,
                 std::int32_t* lists, cudaStream_t s, const bool* due) {
  const int lines = ROWS ? plan.most_rows : plan.most_cols;
  if (plan.num_masks == 0 || lines == 0) return;
  const dim3 grid(static_cast<unsigned>((lines + kWarps - 1) / kWarps),
                  static_cast<unsigned>(std::min(plan.num_masks, 65535)));
  const std::int32_t *row_ptr = plan.row_ptr.data(), *col_idx = plan.col_idx.data();
  walk_lines<ROWS, true><<<grid, kWarps * 32, 0, s>>>(plan.extents.data(), plan.num_masks, kept,
                                                      row_ptr, col_idx, offsets, lists, due);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  scan_lines<ROWS><<<static_cast<unsigned>(plan.num_masks), kScanThreads, 0, s>>>(
      plan.extents.data(), offsets, due);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  walk_lines<ROWS, false><<<grid, kWarps * 32, 0, s>>>(plan.extents.data(), plan.num_masks, kept,
                                                       row_ptr, col_idx, offsets, lists, due);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fill_from_kept(block_sparse_device_plan& plan, const device_kept& kept, cudaStream_t stream,
                    const bool* due) {
  build_lists<true>(plan, kept, plan.row_ptr.data(), plan.col_idx.data(), stream, due);
  if (plan.gradients) transpose_on_device(plan, stream, due);
}

void transpose_on_device(block_sparse_device_plan& plan, cudaStream_t stream, const bool* due) {
  build_lists<false>(plan, device_kept{nullptr, 0}, plan.t_ptr.data(), plan.t_idx.data(), stream,
                     due);
}

}  // namespace trisparse::cuda
