#pragma once
// What the CPU layers' fp32 engines share.
#include <algorithm>
#include <initializer_list>

#include "trisparse/core/numeric.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cpu {

/// Whether an fp32 engine takes these views: all f32 (absent ones, data == nullptr, aside).
inline bool all_f32(std::initializer_list<const tensor_view*> views) {
  return std::all_of(views.begin(), views.end(), [](const tensor_view* t) {
    return t->data == nullptr || t->type == dtype::f32;
  });
}

/// Row r, head h of an f32 view.
inline float* f32_at(const tensor_view& t, std::int64_t r, std::int64_t h) {
  return static_cast<float*>(t.data) + t.offset(r, h, 0);
}

/// t as an f32 view: t itself where it is f32 (or absent), else `scratch` holding its values
/// (packed); an output's scratch holds zeros, to be stored back with store_view.
inline tensor_view f32_view(const tensor_view& t, host_tensor& scratch, bool copy = true) {
  if (t.data == nullptr || t.type == dtype::f32) return t;
  scratch = host_tensor(dtype::f32, t.rows, t.heads, t.dim);
  auto* out = reinterpret_cast<float*>(scratch.data());
  if (copy) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t h = 0; h < t.heads; ++h)
        for (std::int64_t d = 0; d < t.dim; ++d)
          out[(r * t.heads + h) * t.dim + d] =
              static_cast<float>(load_as_double(t.data, t.type, t.offset(r, h, d)));
  }
  return scratch.view();
}

/// Stores an f32 view's values into `to` (its dtype) where they are not the same memory.
inline void store_view(const tensor_view& from, const tensor_view& to) {
  if (from.data == to.data || to.data == nullptr) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < to.rows; ++r)
    for (std::int64_t h = 0; h < to.heads; ++h)
      for (std::int64_t d = 0; d < to.dim; ++d)
        store_from_double(to.data, to.type, to.offset(r, h, d),
                          static_cast<const float*>(from.data)[from.offset(r, h, d)]);
}

}  // namespace trisparse::cpu
