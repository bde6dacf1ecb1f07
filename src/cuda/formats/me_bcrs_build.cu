// The ME-BCRS builder on the GPU (me_bcrs_build.cuh):
//   1. check the pattern (unless the caller did);
//   2. sort each window's keys col * height + row % height with the entries' ids
//      (window_sort.cuh);
//   3. one warp per window counts its distinct columns (vectors); scans give row_ptr (vectors)
//      and block_offset (blocks of 8 vectors);
//   4. one warp per window writes the columns, ORs the mask bits and adds each entry's value into
//      its slot, and records the slot of every CSR entry.
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "../common/error.cuh"
#include "../common/grid.cuh"
#include "me_bcrs_build.cuh"
#include "window_sort.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;

template <class Key, int kHeight>
__global__ void count_vectors(const Key* sorted, const std::int64_t* window_begin,
                              std::int64_t windows, std::int64_t* vectors, std::int32_t* blocks) {
  const std::int64_t w = global_warp();
  if (w > windows) return;
  if (w == windows) {  // the scans' last element
    if (threadIdx.x % 32 == 0) vectors[w] = blocks[w] = 0;
    return;
  }
  const std::int64_t n =
      walk_window<Key, kHeight>(sorted, window_begin[w], window_begin[w + 1], [](auto...) {});
  if (threadIdx.x % 32 == 0) {
    vectors[w] = n;
    blocks[w] = static_cast<std::int32_t>((n + kMeBlockCols - 1) / kMeBlockCols);
  }
}

template <class Key, int kHeight>
__global__ void fill_windows(const Key* sorted, const std::uint32_t* ids,
                             const std::int64_t* window_begin, std::int64_t windows,
                             const std::int64_t* row_ptr, const float* in_values,
                             std::int32_t* col_idx, std::uint32_t* mask, float* values,
                             std::int64_t* entry_slot) {
  const std::int64_t w = global_warp();
  if (w >= windows) return;
  const std::int64_t start = row_ptr[w], n = row_ptr[w + 1] - start;
  walk_window<Key, kHeight>(sorted, window_begin[w], window_begin[w + 1],
                            [&](std::int64_t i, Key col, int row, std::int64_t rank, bool first) {
                              if (first) col_idx[start + rank] = static_cast<std::int32_t>(col);
                              atomicOr(mask + start + rank, 1u << row);
                              const std::int64_t block = rank / kMeBlockCols * kMeBlockCols;
                              const std::int64_t width = min(std::int64_t{kMeBlockCols}, n - block);
                              const std::int64_t slot =
                                  (start + block) * kHeight + row * width + (rank - block);
                              const std::uint32_t e = ids[i];
                              if (in_values != nullptr)
                                atomicAdd(values + slot, in_values[e]);
                              else
                                values[slot] = 1.0f;  // binary: a repeat is the same entry
                              entry_slot[e] = slot;
                            });
}

template <class Key, int kHeight>
void build(const csr_view& g, const float* in_values, device_me_bcrs& f, cudaStream_t s) {
  const window_sorted<Key> sorted = sort_windows<Key>(g, kHeight, true, s);
  const std::int64_t windows = sorted.windows;
  f.windows = windows;
  f.binary = in_values == nullptr;
  device_buffer<std::int64_t> window_vectors(windows + 1);
  f.row_ptr = device_buffer<std::int64_t>(windows + 1);
  f.window_blocks = device_buffer<std::int32_t>(windows + 1);
  f.block_offset = device_buffer<std::int64_t>(windows + 1);
  const unsigned grid = blocks_for(windows + 1, kThreads / 32);
  count_vectors<Key, kHeight>
      <<<grid, kThreads, 0, s>>>(sorted.keys.data(), sorted.window_begin.data(), windows,
                                 window_vectors.data(), f.window_blocks.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  std::size_t bytes_a = 0, bytes_b = 0;
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, bytes_a, window_vectors.data(),
                                                   f.row_ptr.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, bytes_b, f.window_blocks.data(),
                                                   f.block_offset.data(), windows + 1, s));
  device_buffer<unsigned char> temp(std::max({bytes_a, bytes_b, std::size_t{1}}));
  bytes_a = bytes_b = temp.size();
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), bytes_a, window_vectors.data(),
                                                   f.row_ptr.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), bytes_b, f.window_blocks.data(),
                                                   f.block_offset.data(), windows + 1, s));
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&f.vectors, f.row_ptr.data() + windows, sizeof(std::int64_t),
                                     cudaMemcpyDeviceToHost, s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  f.col_idx = device_buffer<std::int32_t>(f.vectors);
  f.mask = device_buffer<std::uint32_t>(f.vectors);
  f.values = device_buffer<float>(f.slots());
  f.entry_slot = device_buffer<std::int64_t>(g.nnz);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.mask.data(), 0, f.mask.bytes(), s));
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(f.values.data(), 0, f.values.bytes(), s));
  if (g.nnz > 0) {
    fill_windows<Key, kHeight><<<grid, kThreads, 0, s>>>(
        sorted.keys.data(), sorted.ids.data(), sorted.window_begin.data(), windows,
        f.row_ptr.data(), in_values, f.col_idx.data(), f.mask.data(), f.values.data(),
        f.entry_slot.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // the temporaries are freed on return
}

template <int kHeight>
void build_height(const csr_view& g, const float* values, device_me_bcrs& f, cudaStream_t s) {
  if (small_keys(g, kHeight))
    build<std::uint32_t, kHeight>(g, values, f, s);
  else
    build<std::uint64_t, kHeight>(g, values, f, s);
}

}  // namespace

device_me_bcrs build_me_bcrs_device(const csr_view& g, const float* values, int vector_rows,
                                    cudaStream_t s, bool checked) {
  TRISPARSE_EXPECTS_INPUT(
      vector_rows == 8 || vector_rows == 16,
      "ME-BCRS vector_rows must be 8 or 16, not " + std::to_string(vector_rows));
  if (!checked) check_csr_view(g, s);
  device_me_bcrs f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.nnz = g.nnz;
  f.vector_rows = vector_rows;
  if (vector_rows == 8)
    build_height<8>(g, values, f, s);
  else
    build_height<16>(g, values, f, s);
  return f;
}

namespace {

// entry_slot of the permuted pattern's entries -> of the caller's (position p came from entry
// origin[p]).
__global__ void unpermute_entries(const std::int64_t* permuted, const std::int64_t* origin,
                                  std::int64_t nnz, std::int64_t* out) {
  const std::int64_t p = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (p < nnz) out[origin[p]] = permuted[p];
}

}  // namespace

device_me_bcrs build_me_bcrs_device(const csr_graph& g, int vector_rows, cudaStream_t s,
                                    std::span<const std::int64_t> order) {
  const csr_graph permuted = order.empty() ? csr_graph{} : select_rows(g, order);
  const csr_graph& p = order.empty() ? g : permuted;
  const device_buffer<std::int64_t> row_ptr(p.row_ptr);
  const device_buffer<std::int32_t> col_idx(p.col_idx);
  const device_buffer<float> values(p.values);
  device_me_bcrs f =
      build_me_bcrs_device(csr_view{.rows = p.rows,
                                    .cols = p.cols,
                                    .nnz = p.nnz(),
                                    .row_ptr = row_ptr.data(),
                                    .col_idx = col_idx.data()},
                           p.has_values() ? values.data() : nullptr, vector_rows, s, true);
  if (order.empty()) return f;
  std::vector<std::int64_t> origin;
  origin.reserve(static_cast<std::size_t>(g.nnz()));
  for (const std::int64_t r : order) {
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) origin.push_back(e);
  }
  const device_buffer<std::int64_t> origin_d(origin);
  device_buffer<std::int64_t> entry_slot(static_cast<std::size_t>(g.nnz()));
  if (g.nnz() > 0) {
    unpermute_entries<<<blocks_for(g.nnz(), kThreads), kThreads, 0, s>>>(
        f.entry_slot.data(), origin_d.data(), g.nnz(), entry_slot.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  f.entry_slot = std::move(entry_slot);
  f.row_map = device_buffer<std::int64_t>(std::vector<std::int64_t>(order.begin(), order.end()));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));  // the host arrays above die here
  return f;
}

}  // namespace trisparse::cuda
