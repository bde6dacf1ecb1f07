// The BSB builder on the GPU, from a CSR pattern in device memory. Entries of one row window (16
// rows) are contiguous in CSR, so everything is per window:
//   1. check the offsets and the column range (unless the caller did);
//   2. key(e) = col(e) * 16 + row(e) % 16, one warp per window; sort the keys within each window
//      (cub::DeviceSegmentedSort): columns ascending, a column's rows together;
//   3. one warp per window counts its distinct columns -> TCBs = ceil(columns / 8); exclusive
//      scan -> tcb_offset;
//   4. one warp per window writes the compacted columns (padding stays -1) and ORs each entry's
//      bit (row, rank of its column) into the bitmap;
//   5. optionally, window_order: windows by decreasing TCB count (stable radix sort).
// Keys are 32-bit while cols * 16 fits, 64-bit otherwise.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include <algorithm>

#include "../common/error.cuh"
#include "../common/grid.cuh"
#include "bsb_build.cuh"
#include "trisparse/formats/bsb.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

unsigned blocks_for(std::int64_t threads) { return cuda::blocks_for(threads, kThreads); }
unsigned warp_blocks_for(std::int64_t warps) { return cuda::blocks_for(warps, kWarpsPerBlock); }
__device__ __forceinline__ std::int64_t global_warp() {
  return (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) / 32;
}

enum check_flags : int { bad_first = 1, bad_last = 2, decreasing = 4, column_range = 8 };

__global__ void check_csr(const std::int64_t* row_ptr, const std::int32_t* col_idx,
                          std::int64_t rows, std::int64_t cols, std::int64_t nnz, int* flags) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  int f = 0;
  if (i == 0 && row_ptr[0] != 0) f |= bad_first;
  if (i == 0 && row_ptr[rows] != nnz) f |= bad_last;
  if (i < rows && row_ptr[i + 1] < row_ptr[i]) f |= decreasing;
  if (i < nnz && (col_idx[i] < 0 || col_idx[i] >= cols)) f |= column_range;
  if (f != 0) atomicOr(flags, f);
}

// window_begin[w] = row_ptr[min(16 w, rows)] for w in [0, windows].
__global__ void window_offsets(const std::int64_t* row_ptr, std::int64_t rows, std::int64_t windows,
                               std::int64_t* window_begin) {
  const std::int64_t w = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (w <= windows) window_begin[w] = row_ptr[w * 16 < rows ? w * 16 : rows];
}

template <class Key>
__global__ void make_keys(const std::int64_t* row_ptr, const std::int32_t* col_idx,
                          std::int64_t rows, std::int64_t windows, Key* keys) {
  const std::int64_t w = global_warp();
  if (w >= windows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (std::int64_t r = w * 16; r < rows && r < w * 16 + 16; ++r) {
    for (std::int64_t e = row_ptr[r] + lane; e < row_ptr[r + 1]; e += 32)
      keys[e] = static_cast<Key>(col_idx[e]) * 16 + static_cast<Key>(r % 16);
  }
}

// One warp walks its window's sorted keys in chunks of 32; `rank` is each entry's column rank
// (0-based) within the window. fill = false: tcb_count[w] = ceil(distinct columns / 8).
// fill = true: compacted columns and bitmap bits.
template <class Key, bool fill>
__global__ void window_pass(const Key* sorted, const std::int64_t* window_begin,
                            std::int64_t windows, std::int32_t* tcb_count,
                            const std::int64_t* tcb_offset, std::int32_t* col_out,
                            unsigned long long* bitmap) {
  const std::int64_t w = global_warp();
  if (w >= windows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t b = window_begin[w], e = window_begin[w + 1];
  std::int64_t distinct = 0;  // columns before this chunk
  Key prev_last = ~Key{0};    // the previous chunk's last column (none: all ones)
  for (std::int64_t c = b; c < e; c += 32) {
    const std::int64_t i = c + lane;
    const bool valid = i < e;
    const Key col = valid ? sorted[i] / 16 : ~Key{0};
    Key before = __shfl_up_sync(0xFFFFFFFFu, col, 1);
    if (lane == 0) before = prev_last;
    const bool fresh = valid && col != before;
    const unsigned fresh_mask = __ballot_sync(0xFFFFFFFFu, fresh);
    if constexpr (fill) {
      const std::int64_t rank = distinct + __popc(fresh_mask & ((2u << lane) - 1)) - 1;
      if (valid) {
        const std::int64_t tcb = tcb_offset[w] + rank / 8;
        if (fresh) col_out[tcb * 8 + rank % 8] = static_cast<std::int32_t>(col);
        const int bit = static_cast<int>(sorted[i] % 16) * 8 + static_cast<int>(rank % 8);
        atomicOr(bitmap + tcb * 2 + bit / 64, 1ull << (bit % 64));
      }
    }
    distinct += __popc(fresh_mask);
    prev_last = __shfl_sync(0xFFFFFFFFu, col, 31);
  }
  if constexpr (!fill) {
    if (lane == 0) tcb_count[w] = static_cast<std::int32_t>((distinct + 7) / 8);
  }
}

__global__ void iota(std::int32_t* a, std::int64_t n) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n) a[i] = static_cast<std::int32_t>(i);
}

template <class Key>
void build_windows(const csr_view& g, device_bsb& f, cudaStream_t s, bool with_order) {
  const std::int64_t nnz = g.nnz, windows = f.windows;
  device_buffer<std::int64_t> window_begin(windows + 1);
  device_buffer<Key> keys(nnz), sorted(nnz);
  f.window_tcbs = device_buffer<std::int32_t>(windows + 1);
  f.tcb_offset = device_buffer<std::int64_t>(windows + 1);
  window_offsets<<<blocks_for(windows + 1), kThreads, 0, s>>>(g.row_ptr, g.rows, windows,
                                                              window_begin.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  // One temporary-storage buffer, sized for the largest CUB call.
  std::size_t sort_bytes = 0, scan_bytes = 0, order_bytes = 0;
  device_buffer<std::int32_t> ids, sorted_counts;
  TRISPARSE_CUDA_TRY(
      cub::DeviceSegmentedSort::SortKeys(nullptr, sort_bytes, keys.data(), sorted.data(), nnz,
                                         windows, window_begin.data(), window_begin.data() + 1, s));
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
  device_buffer<unsigned char> temp(
      std::max({sort_bytes, scan_bytes, order_bytes, std::size_t{1}}));
  std::size_t temp_bytes = temp.size();

  if (nnz > 0) {
    make_keys<<<warp_blocks_for(windows), kThreads, 0, s>>>(g.row_ptr, g.col_idx, g.rows, windows,
                                                            keys.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    TRISPARSE_CUDA_TRY(cub::DeviceSegmentedSort::SortKeys(
        temp.data(), temp_bytes, keys.data(), sorted.data(), nnz, windows, window_begin.data(),
        window_begin.data() + 1, s));
  }
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.window_tcbs.data() + windows, 0, sizeof(std::int32_t), s));
  if (windows > 0) {
    window_pass<Key, false><<<warp_blocks_for(windows), kThreads, 0, s>>>(
        sorted.data(), window_begin.data(), windows, f.window_tcbs.data(), nullptr, nullptr,
        nullptr);
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
        sorted.data(), window_begin.data(), windows, nullptr, f.tcb_offset.data(), f.col_idx.data(),
        reinterpret_cast<unsigned long long*>(f.bitmap.data()));
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
  TRISPARSE_EXPECTS_INPUT(g.rows >= 0 && g.cols >= 0 && g.nnz >= 0,
                          "a CSR view needs rows, cols, nnz >= 0");
  TRISPARSE_EXPECTS_INPUT(g.rows < (std::int64_t{1} << 35),
                          "too many rows for the GPU BSB builder");
  TRISPARSE_EXPECTS_INPUT(g.row_ptr != nullptr && (g.nnz == 0 || g.col_idx != nullptr),
                          "a CSR view needs row_ptr and (with entries) col_idx");
  if (!checked) {
    device_buffer<int> flags(1);
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(flags.data(), 0, sizeof(int), s));
    check_csr<<<blocks_for(std::max(g.rows, g.nnz)), kThreads, 0, s>>>(g.row_ptr, g.col_idx, g.rows,
                                                                       g.cols, g.nnz, flags.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    int f = 0;
    TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&f, flags.data(), sizeof(int), cudaMemcpyDeviceToHost, s));
    TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
    if (f & bad_first) throw invalid_input("CSR view: row_ptr[0] is not 0");
    if (f & bad_last) {
      throw invalid_input("CSR view: row_ptr[rows] is not nnz (" + std::to_string(g.nnz) + ")");
    }
    if (f & decreasing) throw invalid_input("CSR view: row_ptr decreases");
    if (f & column_range) {
      throw invalid_input("CSR view: a column index is outside [0, " + std::to_string(g.cols) +
                          ")");
    }
  }
  device_bsb f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.windows = (g.rows + 15) / 16;
  if (g.cols <= (std::int64_t{1} << 27))
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
