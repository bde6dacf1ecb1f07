// Work list on the device: count items per window, scan, emit, sort by size (see work_list.cuh).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "error.cuh"
#include "grid.cuh"
#include "work_list.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;

struct counts {
  std::int32_t items, parts, splits;
};
struct add_counts {
  __host__ __device__ counts operator()(const counts& a, const counts& b) const {
    return {a.items + b.items, a.parts + b.parts, a.splits + b.splits};
  }
};

__device__ __forceinline__ std::int32_t pieces(std::int32_t blocks, std::int64_t limit) {
  return blocks > limit ? static_cast<std::int32_t>((blocks + limit - 1) / limit) : 1;
}

// [windows + 1] counts; the last is zero so that the exclusive scan ends with the totals.
__global__ void count_items(const std::int32_t* window_blocks, std::int64_t windows,
                            std::int64_t limit, counts* out) {
  const std::int64_t w = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (w > windows) return;
  if (w == windows) {
    out[w] = {0, 0, 0};
    return;
  }
  const std::int32_t n = pieces(window_blocks[w], limit);
  out[w] = {n, n > 1 ? n : 0, n > 1 ? 1 : 0};
}

__global__ void emit_items(const std::int64_t* block_offset, std::int64_t windows,
                           std::int64_t limit, const counts* offsets, work_item* items,
                           std::int32_t* sizes, split_window* splits) {
  const std::int64_t w = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (w >= windows) return;
  const auto b = static_cast<std::int32_t>(block_offset[w]),
             e = static_cast<std::int32_t>(block_offset[w + 1]);
  const std::int32_t n = pieces(e - b, limit);
  const counts at = offsets[w];
  const auto window = static_cast<std::int32_t>(w);
  if (n == 1) {
    items[at.items] = {window, b, e, -1, -1};
    sizes[at.items] = e - b;
    return;
  }
  splits[at.splits] = {window, at.parts, n};
  for (std::int32_t i = 0; i < n; ++i) {
    const auto cb = static_cast<std::int32_t>(b + std::int64_t{e - b} * i / n);
    const auto ce = static_cast<std::int32_t>(b + std::int64_t{e - b} * (i + 1) / n);
    items[at.items + i] = {window, cb, ce, at.parts + i, at.splits};
    sizes[at.items + i] = ce - cb;
  }
}

// sizes are sorted in decreasing order: the one thread at the edge of `large` writes the count.
__global__ void count_large(const std::int32_t* sizes, std::int64_t n, std::int64_t large,
                            std::int32_t* out) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n && sizes[i] >= large && (i + 1 == n || sizes[i + 1] < large))
    *out = static_cast<std::int32_t>(i + 1);
}

unsigned blocks_for(std::int64_t threads) { return cuda::blocks_for(threads, kThreads); }

}  // namespace

device_work_list build_work_list(const std::int32_t* window_blocks,
                                 const std::int64_t* block_offset, std::int64_t windows,
                                 std::int64_t limit, cudaStream_t s, std::int64_t large) {
  device_buffer<counts> per_window(windows + 1), offsets(windows + 1);
  count_items<<<blocks_for(windows + 1), kThreads, 0, s>>>(window_blocks, windows, limit,
                                                           per_window.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  std::size_t scan_bytes = 0;
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveScan(nullptr, scan_bytes, per_window.data(),
                                                    offsets.data(), add_counts{}, counts{0, 0, 0},
                                                    windows + 1, s));
  device_buffer<unsigned char> scan_temp(std::max<std::size_t>(scan_bytes, 1));
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveScan(scan_temp.data(), scan_bytes, per_window.data(),
                                                    offsets.data(), add_counts{}, counts{0, 0, 0},
                                                    windows + 1, s));
  counts total{};
  TRISPARSE_CUDA_TRY(
      cudaMemcpyAsync(&total, offsets.data() + windows, sizeof(counts), cudaMemcpyDeviceToHost, s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));

  device_work_list list;
  list.num_items = total.items;
  list.num_parts = total.parts;
  list.num_splits = total.splits;
  device_buffer<work_item> unsorted(total.items);
  device_buffer<std::int32_t> sizes(total.items), sorted_sizes(total.items);
  list.items = device_buffer<work_item>(total.items);
  list.splits = device_buffer<split_window>(total.splits);
  if (windows > 0) {
    emit_items<<<blocks_for(windows), kThreads, 0, s>>>(block_offset, windows, limit,
                                                        offsets.data(), unsorted.data(),
                                                        sizes.data(), list.splits.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    std::size_t sort_bytes = 0;
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
        nullptr, sort_bytes, sizes.data(), sorted_sizes.data(), unsorted.data(), list.items.data(),
        total.items, 0, 32, s));
    device_buffer<unsigned char> sort_temp(std::max<std::size_t>(sort_bytes, 1));
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
        sort_temp.data(), sort_bytes, sizes.data(), sorted_sizes.data(), unsorted.data(),
        list.items.data(), total.items, 0, 32, s));
    device_buffer<std::int32_t> num_large(1);  // freed after the synchronisation below
    if (large > 0 && total.items > 0) {
      TRISPARSE_CUDA_TRY(cudaMemsetAsync(num_large.data(), 0, sizeof(std::int32_t), s));
      count_large<<<blocks_for(total.items), kThreads, 0, s>>>(sorted_sizes.data(), total.items,
                                                               large, num_large.data());
      TRISPARSE_CUDA_CHECK_LAUNCH();
      TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&list.num_large, num_large.data(), sizeof(std::int32_t),
                                         cudaMemcpyDeviceToHost, s));
    }
    TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // the temporaries are freed on return
  }
  list.sizes = std::move(sorted_sizes);
  return list;
}

}  // namespace trisparse::cuda
