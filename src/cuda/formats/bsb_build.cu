// The BSB builder on the GPU. Steps, all on the device:
//   1. key(e) = window(row(e)) << 32 | col(e) for every entry; radix-sort the keys;
//   2. unique keys = each window's compacted columns, in order (cub::DeviceSelect::Unique);
//   3. each window's first unique key by binary search; TCBs per window = ceil(columns / 8);
//      exclusive scan -> tcb_offset;
//   4. col_idx from the unique keys (padding stays -1); bitmap bits by each entry's rank among its
//      window's columns (atomicOr);
//   5. window_order: windows sorted by decreasing TCB count with a stable radix sort.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include <algorithm>

#include "../common/error.cuh"
#include "bsb_build.cuh"
#include "trisparse/formats/bsb.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ std::int64_t row_of(const std::int64_t* row_ptr, std::int64_t rows,
                                               std::int64_t e) {
  std::int64_t lo = 0, hi = rows;  // the last r with row_ptr[r] <= e
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (row_ptr[mid] <= e)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

__device__ __forceinline__ std::int64_t lower_bound(const std::uint64_t* a, std::int64_t lo,
                                                    std::int64_t hi, std::uint64_t key) {
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (a[mid] < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

__global__ void make_keys(const std::int64_t* row_ptr, const std::int32_t* col_idx,
                          std::int64_t rows, std::int64_t nnz, std::uint64_t* keys) {
  const std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (e >= nnz) return;
  const std::int64_t r = row_of(row_ptr, rows, e);
  keys[e] = (static_cast<std::uint64_t>(r / 16) << 32) | static_cast<std::uint32_t>(col_idx[e]);
}

__global__ void window_starts(const std::uint64_t* uniq, const std::int64_t* num_uniq,
                              std::int64_t windows, std::int64_t* start, std::int64_t* tcb_count) {
  const std::int64_t w = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (w > windows) return;
  const std::int64_t n = *num_uniq;
  start[w] = lower_bound(uniq, 0, n, static_cast<std::uint64_t>(w) << 32);
  if (w < windows) {
    const std::int64_t next = lower_bound(uniq, 0, n, static_cast<std::uint64_t>(w + 1) << 32);
    tcb_count[w] = (next - start[w] + 7) / 8;
  } else {
    tcb_count[w] = 0;  // the scan's last element: tcb_offset[windows] = total
  }
}

__global__ void fill_columns(const std::uint64_t* uniq, const std::int64_t* num_uniq,
                             const std::int64_t* start, const std::int64_t* tcb_offset,
                             std::int32_t* col_idx) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= *num_uniq) return;
  const std::uint64_t key = uniq[i];
  const auto w = static_cast<std::int64_t>(key >> 32);
  col_idx[tcb_offset[w] * 8 + (i - start[w])] = static_cast<std::int32_t>(key & 0xFFFFFFFFu);
}

__global__ void fill_bits(const std::int64_t* row_ptr, const std::int32_t* col_idx_csr,
                          std::int64_t rows, std::int64_t nnz, const std::uint64_t* uniq,
                          const std::int64_t* start, const std::int64_t* tcb_offset,
                          unsigned long long* bitmap) {
  const std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (e >= nnz) return;
  const std::int64_t r = row_of(row_ptr, rows, e), w = r / 16;
  const std::uint64_t key =
      (static_cast<std::uint64_t>(w) << 32) | static_cast<std::uint32_t>(col_idx_csr[e]);
  const std::int64_t slot = lower_bound(uniq, start[w], start[w + 1], key) - start[w];
  const std::int64_t tcb = tcb_offset[w] + slot / 8;
  const int bit = static_cast<int>((r % 16) * 8 + slot % 8);
  atomicOr(bitmap + tcb * 2 + bit / 64, 1ull << (bit % 64));
}

__global__ void iota(std::int32_t* a, std::int64_t n) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n) a[i] = static_cast<std::int32_t>(i);
}

unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (n + kThreads - 1) / kThreads));
}

}  // namespace

device_bsb build_bsb_device(const csr_graph& g, cudaStream_t s) {
  TRISPARSE_EXPECTS_INPUT(g.rows < (std::int64_t{1} << 35),
                          "too many rows for the GPU BSB builder");
  device_bsb f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.windows = (g.rows + 15) / 16;
  const std::int64_t nnz = g.nnz(), windows = f.windows;
  const device_buffer<std::int64_t> row_ptr(g.row_ptr);
  const device_buffer<std::int32_t> col_idx(g.col_idx);
  device_buffer<std::uint64_t> keys(nnz), sorted(nnz), uniq(nnz);
  device_buffer<std::int64_t> num_uniq(1), start(windows + 1), tcb_count(windows + 1);
  f.tcb_offset = device_buffer<std::int64_t>(windows + 1);
  device_buffer<std::int32_t> ids(windows);
  f.window_order = device_buffer<std::int32_t>(windows);
  device_buffer<std::int64_t> tcb_count_sorted(windows);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(num_uniq.data(), 0, sizeof(std::int64_t), s));

  int window_bits = 1;
  while ((std::int64_t{1} << window_bits) <= windows) ++window_bits;
  // One temporary-storage buffer, sized for the largest CUB call.
  std::size_t sort_bytes = 0, unique_bytes = 0, scan_bytes = 0, order_bytes = 0;
  TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(nullptr, sort_bytes, keys.data(), sorted.data(),
                                                    nnz, 0, 32 + window_bits, s));
  TRISPARSE_CUDA_TRY(cub::DeviceSelect::Unique(nullptr, unique_bytes, sorted.data(), uniq.data(),
                                               num_uniq.data(), nnz, s));
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, tcb_count.data(),
                                                   f.tcb_offset.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
      nullptr, order_bytes, tcb_count.data(), tcb_count_sorted.data(), ids.data(),
      f.window_order.data(), windows, 0, 64, s));
  device_buffer<unsigned char> temp(
      std::max({sort_bytes, unique_bytes, scan_bytes, order_bytes, std::size_t{1}}));
  std::size_t temp_bytes = temp.size();

  if (nnz > 0) {
    make_keys<<<blocks_for(nnz), kThreads, 0, s>>>(row_ptr.data(), col_idx.data(), g.rows, nnz,
                                                   keys.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    temp_bytes = temp.size();
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(temp.data(), temp_bytes, keys.data(),
                                                      sorted.data(), nnz, 0, 32 + window_bits, s));
    temp_bytes = temp.size();
    TRISPARSE_CUDA_TRY(cub::DeviceSelect::Unique(temp.data(), temp_bytes, sorted.data(),
                                                 uniq.data(), num_uniq.data(), nnz, s));
  }
  window_starts<<<blocks_for(windows + 1), kThreads, 0, s>>>(uniq.data(), num_uniq.data(), windows,
                                                             start.data(), tcb_count.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  temp_bytes = temp.size();
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), temp_bytes, tcb_count.data(),
                                                   f.tcb_offset.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&f.tcbs, f.tcb_offset.data() + windows, sizeof(std::int64_t),
                                     cudaMemcpyDeviceToHost, s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  f.col_idx = device_buffer<std::int32_t>(f.tcbs * 8);
  f.bitmap = device_buffer<std::uint64_t>(f.tcbs * 2);
  TRISPARSE_CUDA_TRY(
      cudaMemsetAsync(f.col_idx.data(), 0xFF, f.col_idx.bytes(), s));  // -1 = padding
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.bitmap.data(), 0, f.bitmap.bytes(), s));
  if (nnz > 0) {
    fill_columns<<<blocks_for(nnz), kThreads, 0, s>>>(uniq.data(), num_uniq.data(), start.data(),
                                                      f.tcb_offset.data(), f.col_idx.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    fill_bits<<<blocks_for(nnz), kThreads, 0, s>>>(
        row_ptr.data(), col_idx.data(), g.rows, nnz, uniq.data(), start.data(), f.tcb_offset.data(),
        reinterpret_cast<unsigned long long*>(f.bitmap.data()));
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  if (windows > 0) {
    iota<<<blocks_for(windows), kThreads, 0, s>>>(ids.data(), windows);
    TRISPARSE_CUDA_CHECK_LAUNCH();
    temp_bytes = temp.size();
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
        temp.data(), temp_bytes, tcb_count.data(), tcb_count_sorted.data(), ids.data(),
        f.window_order.data(), windows, 0, 64, s));
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // the temporaries are freed on return
  return f;
}

}  // namespace trisparse::cuda

namespace trisparse {

bsb build_bsb_cuda(const csr_graph& pattern) {
  pattern.check();
  const cuda::device_bsb d = cuda::build_bsb_device(pattern);
  bsb f;
  f.rows = d.rows;
  f.cols = d.cols;
  f.tcb_cols = 8;
  f.tcb_offset.resize(d.windows + 1);
  f.col_idx.resize(d.tcbs * 8);
  f.bitmap.resize(d.tcbs * 2);
  f.window_order.resize(d.windows);
  const auto down = [](auto& host, const auto& dev) {
    if (!host.empty())
      TRISPARSE_CUDA_TRY(cudaMemcpy(host.data(), dev.data(), dev.bytes(), cudaMemcpyDeviceToHost));
  };
  down(f.tcb_offset, d.tcb_offset);
  down(f.col_idx, d.col_idx);
  down(f.bitmap, d.bitmap);
  down(f.window_order, d.window_order);
  return f;
}

}  // namespace trisparse
