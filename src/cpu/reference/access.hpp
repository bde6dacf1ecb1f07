#pragma once
// Element access of the float64 references (internal): every view read and written as double.
#include <cstdint>

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

}  // namespace trisparse::reference::access
