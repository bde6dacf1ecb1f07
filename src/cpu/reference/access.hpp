#pragma once
// Element access of the float64 references (internal): every view read and written as double.
#include <cstdint>
#include <vector>

#include "trisparse/core/numeric.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::reference::access {

inline double at(const tensor_view& t, std::int64_t r, std::int64_t h, std::int64_t d) {
  return load_as_double(t.data, t.type, t.offset(r, h, d));
}
inline void put(const tensor_view& t, std::int64_t r, std::int64_t h, std::int64_t d, double x) {
  store_from_double(t.data, t.type, t.offset(r, h, d), x);
}
/// <x[i, h, :], y[j, h, :]>.
inline double dot(const tensor_view& x, std::int64_t i, const tensor_view& y, std::int64_t j,
                  std::int64_t h) {
  double s = 0;
  for (std::int64_t d = 0; d < x.dim; ++d) s += at(x, i, h, d) * at(y, j, h, d);
  return s;
}

/// A [rows, heads, dim] float64 accumulator, written to a view at the end.
struct accumulator {
  std::int64_t heads, dim;
  std::vector<double> g;
  accumulator(std::int64_t rows, std::int64_t h, std::int64_t d)
      : heads(h), dim(d), g(static_cast<std::size_t>(rows * h * d), 0.0) {}
  double& operator()(std::int64_t r, std::int64_t h, std::int64_t d) {
    return g[static_cast<std::size_t>((r * heads + h) * dim + d)];
  }
  void store(const tensor_view& t) {
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t d = 0; d < dim; ++d) put(t, r, h, d, (*this)(r, h, d));
  }
};

/// t's elements as a packed float64 tensor (read once, so that the loops over entries read doubles
/// instead of converting 16-bit values at every use; the values are the same).
inline host_tensor as_f64(const tensor_view& t) {
  host_tensor out(dtype::f64, t.rows, t.heads, t.dim);
  if (t.data == nullptr) return out;
  auto* o = reinterpret_cast<double*>(out.data());
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < t.rows; ++r)
    for (std::int64_t h = 0; h < t.heads; ++h)
      for (std::int64_t d = 0; d < t.dim; ++d) o[(r * t.heads + h) * t.dim + d] = at(t, r, h, d);
  return out;
}

}  // namespace trisparse::reference::access
