#pragma once
// What the CPU layers' engines share: typed access to views and copies into the engine's type
// (fp32 for f16, bf16 and f32 tensors; float64 for float64 ones).
#include <algorithm>
#include <initializer_list>

#include "../common/compute_type.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cpu {

/// Whether an fp32 engine takes these views: all f32 (absent ones, data == nullptr, aside).
inline bool all_f32(std::initializer_list<const tensor_view*> views) {
  return std::all_of(views.begin(), views.end(), [](const tensor_view* t) {
    return t->data == nullptr || t->type == dtype::f32;
  });
}

/// Row r, head h of a view holding T.
template <class T>
T* typed_at(const tensor_view& t, std::int64_t r, std::int64_t h) {
  return static_cast<T*>(t.data) + t.offset(r, h, 0);
}
inline float* f32_at(const tensor_view& t, std::int64_t r, std::int64_t h) {
  return typed_at<float>(t, r, h);
}

/// t as a view of T: t itself where it holds T (or is absent), else `scratch` holding its values
/// (packed); an output's scratch holds zeros, to be stored back with store_view.
template <class T>
tensor_view typed_view(const tensor_view& t, host_tensor& scratch, bool copy = true) {
  if (t.data == nullptr || t.type == dtype_of<T>) return t;
  scratch = host_tensor(dtype_of<T>, t.rows, t.heads, t.dim);
  auto* out = reinterpret_cast<T*>(scratch.data());
  if (copy) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t h = 0; h < t.heads; ++h)
        for (std::int64_t d = 0; d < t.dim; ++d)
          out[(r * t.heads + h) * t.dim + d] =
              static_cast<T>(load_as_double(t.data, t.type, t.offset(r, h, d)));
  }
  return scratch.view();
}
inline tensor_view f32_view(const tensor_view& t, host_tensor& scratch, bool copy = true) {
  return typed_view<float>(t, scratch, copy);
}

/// Stores a view of T's values into `to` (its dtype) where they are not the same memory.
template <class T = float>
void store_view(const tensor_view& from, const tensor_view& to) {
  if (from.data == to.data || to.data == nullptr) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < to.rows; ++r)
    for (std::int64_t h = 0; h < to.heads; ++h)
      for (std::int64_t d = 0; d < to.dim; ++d)
        store_from_double(to.data, to.type, to.offset(r, h, d),
                          static_cast<const T*>(from.data)[from.offset(r, h, d)]);
}

}  // namespace trisparse::cpu
