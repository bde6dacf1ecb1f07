#pragma once
/// @file Dense tensors: non-owning views with shape, strides, dtype and device, and a host owner.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "trisparse/core/dtype.hpp"

namespace trisparse {

/// Where a buffer lives.
enum class device_kind : std::uint8_t { cpu, cuda };

/// "cpu" or "cuda".
const char* to_string(device_kind d);

/// Non-owning view of a [rows, heads, dim] tensor; strides in elements, the dim stride is 1.
/// Trivially copyable, so kernels can take it by value.
struct tensor_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  device_kind where = device_kind::cpu;
  int device_id = 0;
  std::int64_t rows = 0;
  std::int64_t heads = 1;
  std::int64_t dim = 0;
  std::int64_t row_stride = 0;   ///< elements between rows
  std::int64_t head_stride = 0;  ///< elements between heads

  /// A densely packed [rows, heads, dim] view.
  static tensor_view contiguous(void* data, dtype type, std::int64_t rows, std::int64_t heads,
                                std::int64_t dim, device_kind where = device_kind::cpu,
                                int device_id = 0) {
    return {data, type, where, device_id, rows, heads, dim, heads * dim, dim};
  }
  /// Offset in elements of element (r, h, d).
  std::int64_t offset(std::int64_t r, std::int64_t h, std::int64_t d) const {
    return r * row_stride + h * head_stride + d;
  }
  std::int64_t numel() const { return rows * heads * dim; }
  /// "[rows, heads, dim] f16 on cpu" for messages.
  std::string describe() const;
};

/// Throws invalid_input naming `what` unless t has the given shape (a negative value matches any),
/// non-null data (when it has elements), non-negative strides and non-overlapping rows and heads.
void check_view(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads,
                std::int64_t dim);

/// An owning, densely packed host tensor.
class host_tensor {
 public:
  host_tensor() = default;
  host_tensor(dtype type, std::int64_t rows, std::int64_t heads, std::int64_t dim);
  tensor_view view() { return tensor_view::contiguous(bytes_.data(), type_, rows_, heads_, dim_); }
  tensor_view view() const {
    return tensor_view::contiguous(const_cast<std::byte*>(bytes_.data()), type_, rows_, heads_,
                                   dim_);
  }
  dtype type() const { return type_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t heads() const { return heads_; }
  std::int64_t dim() const { return dim_; }
  std::int64_t numel() const { return rows_ * heads_ * dim_; }
  double get(std::int64_t i) const;
  void set(std::int64_t i, double x);
  void fill(double x);
  /// Fills with values uniform in [lo, hi) from a seeded, platform-independent generator (in
  /// parallel; the values do not depend on the thread count).
  void fill_uniform(double lo, double hi, std::uint64_t seed);
  std::byte* data() { return bytes_.data(); }
  const std::byte* data() const { return bytes_.data(); }
  std::size_t size_bytes() const { return bytes_.size(); }

 private:
  dtype type_ = dtype::f32;
  std::int64_t rows_ = 0, heads_ = 1, dim_ = 0;
  std::vector<std::byte> bytes_;
};

/// An owning, densely packed tensor on the current CUDA device (cudaMalloc). Without the CUDA
/// backend every constructor throws not_supported.
class device_tensor {
 public:
  device_tensor() = default;
  device_tensor(dtype type, std::int64_t rows, std::int64_t heads, std::int64_t dim);
  /// A device copy of a host tensor (synchronous).
  explicit device_tensor(const host_tensor& host);
  ~device_tensor();  // NOLINT(performance-trivially-destructible): not in CUDA builds
  device_tensor(device_tensor&& other) noexcept;
  device_tensor& operator=(device_tensor&& other) noexcept;
  device_tensor(const device_tensor&) = delete;
  device_tensor& operator=(const device_tensor&) = delete;

  tensor_view view() const;
  /// A host copy (synchronises the device first).
  host_tensor to_host() const;
  /// Sets every byte (0xFF poisons floats with NaN).
  void fill_bytes(unsigned char value);

 private:
  dtype type_ = dtype::f32;
  std::int64_t rows_ = 0, heads_ = 1, dim_ = 0;
  int device_ = 0;
  void* data_ = nullptr;
};

/// Waits for all work on the current CUDA device (a no-op without the CUDA backend).
/// @throws cuda_error if earlier asynchronous work failed.
void device_synchronize();

}  // namespace trisparse
