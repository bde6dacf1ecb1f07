#include "trisparse/core/tensor.hpp"

#include <algorithm>

#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/core/random.hpp"

namespace trisparse {

const char* to_string(device_kind d) { return d == device_kind::cpu ? "cpu" : "cuda"; }

std::string tensor_view::describe() const {
  return "[" + std::to_string(rows) + ", " + std::to_string(heads) + ", " + std::to_string(dim) +
         "] " + std::string(to_string(type)) + " on " + to_string(where);
}

void check_view(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads,
                std::int64_t dim) {
  const auto fail = [&](const std::string& why) {
    throw invalid_input(std::string(what) + " " + t.describe() + ": " + why);
  };
  if (rows >= 0 && t.rows != rows) fail("expected " + std::to_string(rows) + " rows");
  if (heads >= 0 && t.heads != heads) fail("expected " + std::to_string(heads) + " heads");
  if (dim >= 0 && t.dim != dim) fail("expected dim " + std::to_string(dim));
  if (t.rows < 0 || t.heads < 1 || t.dim < 1) fail("needs rows >= 0, heads >= 1, dim >= 1");
  if (t.numel() > 0 && t.data == nullptr) fail("data is null");
  // Rows outside heads ([rows, heads, dim] packed) or heads outside rows (one array per head).
  const bool heads_inner = (t.heads == 1 || t.head_stride >= t.dim) &&
                           (t.rows <= 1 || t.row_stride >= t.head_stride * (t.heads - 1) + t.dim);
  const bool rows_inner = (t.rows <= 1 || t.row_stride >= t.dim) &&
                          (t.heads == 1 || t.head_stride >= t.row_stride * (t.rows - 1) + t.dim);
  if (!heads_inner && !rows_inner) {
    fail("row_stride " + std::to_string(t.row_stride) + " and head_stride " +
         std::to_string(t.head_stride) + " make elements overlap");
  }
}

host_tensor::host_tensor(dtype type, std::int64_t rows, std::int64_t heads, std::int64_t dim)
    : type_(type), rows_(rows), heads_(heads), dim_(dim) {
  TRISPARSE_EXPECTS_INPUT(rows >= 0 && heads >= 1 && dim >= 1,
                          "host_tensor needs rows >= 0, heads >= 1, dim >= 1");
  bytes_.resize(static_cast<std::size_t>(rows * heads * dim) * size_of(type));
}

double host_tensor::get(std::int64_t i) const { return load_as_double(bytes_.data(), type_, i); }
void host_tensor::set(std::int64_t i, double x) { store_from_double(bytes_.data(), type_, i, x); }
void host_tensor::fill(double x) {
  for (std::int64_t i = 0; i < numel(); ++i) set(i, x);
}
void host_tensor::fill_uniform(double lo, double hi, std::uint64_t seed) {
  // Independent streams per chunk: parallel, and the same values whatever the thread count.
  constexpr std::int64_t kChunk = 1 << 14;
  const std::int64_t n = numel();
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    rng r(seed ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(c + 1)));
    for (std::int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
      set(i, lo + (hi - lo) * r.uniform());
  }
}

}  // namespace trisparse
