#pragma once
// What the CPU layers' fp32 engines share.
#include <algorithm>
#include <initializer_list>

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

}  // namespace trisparse::cpu
