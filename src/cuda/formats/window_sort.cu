// Validation and the per-window key sort shared by the GPU format builders (window_sort.cuh).
#include <cub/device/device_segmented_sort.cuh>

#include <algorithm>
#include <string>

#include "../common/error.cuh"
#include "../common/grid.cuh"
#include "window_sort.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;

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

// window_begin[w] = row_ptr[min(height w, rows)] for w in [0, windows].
__global__ void window_offsets(const std::int64_t* row_ptr, std::int64_t rows, int height,
                               std::int64_t windows, std::int64_t* window_begin) {
  const std::int64_t w = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (w <= windows) window_begin[w] = row_ptr[w * height < rows ? w * height : rows];
}

template <class Key>
__global__ void make_keys(const std::int64_t* row_ptr, const std::int32_t* col_idx,
                          std::int64_t rows, int height, std::int64_t windows, Key* keys,
                          std::uint32_t* ids) {
  const std::int64_t w = global_warp();
  if (w >= windows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (std::int64_t r = w * height; r < rows && r < (w + 1) * height; ++r) {
    for (std::int64_t e = row_ptr[r] + lane; e < row_ptr[r + 1]; e += 32) {
      keys[e] = static_cast<Key>(col_idx[e]) * height + static_cast<Key>(r % height);
      if (ids != nullptr) ids[e] = static_cast<std::uint32_t>(e);
    }
  }
}

}  // namespace

void check_csr_view(const csr_view& g, cudaStream_t s) {
  TRISPARSE_EXPECTS_INPUT(g.rows >= 0 && g.cols >= 0 && g.nnz >= 0,
                          "a CSR view needs rows, cols, nnz >= 0");
  TRISPARSE_EXPECTS_INPUT(g.row_ptr != nullptr && (g.nnz == 0 || g.col_idx != nullptr),
                          "a CSR view needs row_ptr and (with entries) col_idx");
  device_buffer<int> flags(1);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(flags.data(), 0, sizeof(int), s));
  check_csr<<<blocks_for(std::max(g.rows, g.nnz), kThreads), kThreads, 0, s>>>(
      g.row_ptr, g.col_idx, g.rows, g.cols, g.nnz, flags.data());
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
    throw invalid_input("CSR view: a column index is outside [0, " + std::to_string(g.cols) + ")");
  }
}

template <class Key>
window_sorted<Key> sort_windows(const csr_view& g, int height, bool with_ids, cudaStream_t s) {
  TRISPARSE_EXPECTS_INPUT(!with_ids || g.nnz < (std::int64_t{1} << 32),
                          "the GPU builder handles fewer than 2^32 entries with values");
  window_sorted<Key> out;
  const std::int64_t nnz = g.nnz;
  out.windows = (g.rows + height - 1) / height;
  out.window_begin = device_buffer<std::int64_t>(out.windows + 1);
  out.keys = device_buffer<Key>(nnz);
  window_offsets<<<blocks_for(out.windows + 1, kThreads), kThreads, 0, s>>>(
      g.row_ptr, g.rows, height, out.windows, out.window_begin.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  if (nnz == 0) return out;
  device_buffer<Key> keys(nnz);
  device_buffer<std::uint32_t> ids;
  if (with_ids) {
    ids = device_buffer<std::uint32_t>(nnz);
    out.ids = device_buffer<std::uint32_t>(nnz);
  }
  make_keys<<<blocks_for(out.windows, kThreads / 32), kThreads, 0, s>>>(
      g.row_ptr, g.col_idx, g.rows, height, out.windows, keys.data(), ids.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  std::size_t bytes = 0;
  const auto sort = [&](void* temp) {
    if (with_ids) {
      TRISPARSE_CUDA_TRY(cub::DeviceSegmentedSort::SortPairs(
          temp, bytes, keys.data(), out.keys.data(), ids.data(), out.ids.data(), nnz, out.windows,
          out.window_begin.data(), out.window_begin.data() + 1, s));
    } else {
      TRISPARSE_CUDA_TRY(cub::DeviceSegmentedSort::SortKeys(
          temp, bytes, keys.data(), out.keys.data(), nnz, out.windows, out.window_begin.data(),
          out.window_begin.data() + 1, s));
    }
  };
  sort(nullptr);
  device_buffer<unsigned char> temp(std::max<std::size_t>(bytes, 1));
  sort(temp.data());
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // keys, ids and temp are freed on return
  return out;
}

template window_sorted<std::uint32_t> sort_windows(const csr_view&, int, bool, cudaStream_t);
template window_sorted<std::uint64_t> sort_windows(const csr_view&, int, bool, cudaStream_t);

}  // namespace trisparse::cuda
