// The BSB builder on the GPU, from a CSR pattern in device memory:
//   1. check the offsets and the column range (unless the caller did);
//   2. sort each 16-row window's keys col * 16 + row % 16 (window_sort.cuh);
//   3. one warp per window counts its distinct columns -> TCBs = ceil(columns / 8); exclusive
//      scan -> tcb_offset;
//   4. one warp per window writes the compacted columns (padding stays -1) and ORs each entry's
//      bit (row, rank of its column) into the bitmap;
//   5. optionally, window_order: windows by decreasing TCB count (stable radix sort).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "../common/error.cuh"
#include "../common/grid.cuh"
#include "bsb_build.cuh"
#include "bsb_host.hpp"
#include "trisparse/formats/bsb.hpp"
#include "window_sort.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

unsigned blocks_for(std::int64_t threads) { return cuda::blocks_for(threads, kThreads); }
unsigned warp_blocks_for(std::int64_t warps) { return cuda::blocks_for(warps, kWarpsPerBlock); }

// fill = false: tcb_count[w] = ceil(distinct columns / 8). fill = true: compacted columns and
// bitmap bits.
template <class Key, bool fill>
__global__ void window_pass(const Key* sorted, const std::int64_t* window_begin,
                            std::int64_t windows, std::int32_t* tcb_count,
                            const std::int64_t* tcb_offset, std::int32_t* col_out,
                            unsigned long long* bitmap) {
  const std::int64_t w = global_warp();
  if (w >= windows) return;
  const std::int64_t distinct =
      walk_window<Key, 16>(sorted, window_begin[w], window_begin[w + 1],
                           [&](std::int64_t, Key col, int row, std::int64_t rank, bool first) {
                             if constexpr (fill) {
                               const std::int64_t tcb = tcb_offset[w] + rank / 8;
                               if (first)
                                 col_out[tcb * 8 + rank % 8] = static_cast<std::int32_t>(col);
                               const int bit = row * 8 + static_cast<int>(rank % 8);
                               atomicOr(bitmap + tcb * 2 + bit / 64, 1ull << (bit % 64));
                             }
                           });
  if constexpr (!fill) {
    if (threadIdx.x % 32 == 0) tcb_count[w] = static_cast<std::int32_t>((distinct + 7) / 8);
  }
}

__global__ void iota(std::int32_t* a, std::int64_t n) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n) a[i] = static_cast<std::int32_t>(i);
}

template <class Key>
void build_windows(const csr_view& g, device_bsb& f, cudaStream_t s, bool with_order) {
  const std::int64_t nnz = g.nnz, windows = f.windows;
  const window_sorted<Key> sorted = sort_windows<Key>(g, 16, false, s);
  f.window_tcbs = device_buffer<std::int32_t>(windows + 1);
  f.tcb_offset = device_buffer<std::int64_t>(windows + 1);
  // One temporary-storage buffer, sized for the largest CUB call.
  std::size_t scan_bytes = 0, order_bytes = 0;
  device_buffer<std::int32_t> ids, sorted_counts;
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, f.window_tcbs.data(),
                                                   f.tcb_offset.data(), windows + 1, s));
  if (with_order) {
    ids = device_buffer<std::int32_t>(windows);
    sorted_counts = device_buffer<std::int32_t>(windows);
    f.window_order = device_buffer<std::int32_t>(windows);
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
        nullptr, order_bytes, f.window_tcbs.data(), sorted_counts.data(), ids.data(),
        f.window_order.data(), windows, 0, 32, s));
  }
  device_buffer<unsigned char> temp(std::max({scan_bytes, order_bytes, std::size_t{1}}));
  std::size_t temp_bytes = temp.size();
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.window_tcbs.data() + windows, 0, sizeof(std::int32_t), s));
  if (windows > 0) {
    window_pass<Key, false><<<warp_blocks_for(windows), kThreads, 0, s>>>(
        sorted.keys.data(), sorted.window_begin.data(), windows, f.window_tcbs.data(), nullptr,
        nullptr, nullptr);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  temp_bytes = temp.size();
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), temp_bytes, f.window_tcbs.data(),
                                                   f.tcb_offset.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&f.tcbs, f.tcb_offset.data() + windows, sizeof(std::int64_t),
                                     cudaMemcpyDeviceToHost, s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  f.col_idx = device_buffer<std::int32_t>(f.tcbs * 8);
  f.bitmap = device_buffer<std::uint64_t>(f.tcbs * 2);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.col_idx.data(), 0xFF, f.col_idx.bytes(), s));  // -1
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.bitmap.data(), 0, f.bitmap.bytes(), s));
  if (nnz > 0) {
    window_pass<Key, true><<<warp_blocks_for(windows), kThreads, 0, s>>>(
        sorted.keys.data(), sorted.window_begin.data(), windows, nullptr, f.tcb_offset.data(),
        f.col_idx.data(), reinterpret_cast<unsigned long long*>(f.bitmap.data()));
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  if (with_order && windows > 0) {
    iota<<<blocks_for(windows), kThreads, 0, s>>>(ids.data(), windows);
    TRISPARSE_CUDA_CHECK_LAUNCH();
    temp_bytes = temp.size();
    TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(
        temp.data(), temp_bytes, f.window_tcbs.data(), sorted_counts.data(), ids.data(),
        f.window_order.data(), windows, 0, 32, s));
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // the temporaries are freed on return
}

}  // namespace

device_bsb build_bsb_device(const csr_view& g, cudaStream_t s, bool checked, bool with_order) {
  TRISPARSE_EXPECTS_INPUT(g.rows < (std::int64_t{1} << 35),
                          "too many rows for the GPU BSB builder");
  if (!checked) check_csr_view(g, s);
  device_bsb f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.windows = (g.rows + 15) / 16;
  if (small_keys(g, 16))
    build_windows<std::uint32_t>(g, f, s, with_order);
  else
    build_windows<std::uint64_t>(g, f, s, with_order);
  return f;
}

device_bsb build_bsb_device(const csr_graph& g, cudaStream_t s, bool with_order) {
  const device_buffer<std::int64_t> row_ptr(g.row_ptr);
  const device_buffer<std::int32_t> col_idx(g.col_idx);
  return build_bsb_device(csr_view{.rows = g.rows,
                                   .cols = g.cols,
                                   .nnz = g.nnz(),
                                   .row_ptr = row_ptr.data(),
                                   .col_idx = col_idx.data()},
                          s, true, with_order);
}

}  // namespace trisparse::cuda

namespace trisparse {

bsb build_bsb_cuda(const csr_graph& pattern) {
  pattern.check();
  const cuda::device_bsb d = cuda::build_bsb_device(pattern, nullptr, true);
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
