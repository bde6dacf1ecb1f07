#pragma once
// Heads in lane groups: how the row-wise kernels (the fused GAT, the CUDA-core attention) spread
// the heads of one row over a warp.
//
// A head of C channels is read in V-element vectors by L lanes (a power of two,
// L = min(32, bit_ceil(C / V))), lane `sub` of them taking vectors sub, sub + L, ... (K = F / V
// vectors, F floats a lane). A warp holds 32 / L heads at once (a head group), so the lanes of a
// head sit in one aligned segment and a head's dot product is a butterfly over L lanes, which
// gives every lane the same bits. V is the widest vector that the operands' alignment allows and
// that still fills the warp.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string_view>

#include "convert.cuh"
#include "dispatch.cuh"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cuda::head_lanes {

struct lanes {
  int heads = 1, width = 0;
  int per_head = 1;  // L
  int chunks = 1;    // K
  int groups = 1;    // head groups
};

inline lanes layout_of(int heads, int width, int vec) {
  lanes l;
  l.heads = heads;
  l.width = width;
  const int vectors = std::max(1, (width + vec - 1) / vec);
  l.per_head = std::min(32, static_cast<int>(std::bit_ceil(static_cast<unsigned>(vectors))));
  l.chunks = (vectors + l.per_head - 1) / l.per_head;
  const int per_warp = 32 / l.per_head;
  l.groups = (heads + per_warp - 1) / per_warp;
  return l;
}

// The widest V <= max_vec dividing every width in `widths` (the layout's is their largest) with
// every operand aligned for it, narrowed while the warp's heads leave lanes idle.
inline int vector_of(int heads, std::initializer_list<int> widths, int max_vec,
                     std::initializer_list<const tensor_view*> ts) {
  const int width = std::max(widths);
  const auto fits = [&](int v) {
    for (const int w : widths)
      if (w % v != 0) return false;
    for (const tensor_view* t : ts) {
      const std::size_t align = std::min<std::size_t>(16, v * size_of(t->type));
      if (reinterpret_cast<std::uintptr_t>(t->data) % align != 0) return false;
      if ((t->rows > 1 && t->row_stride % v != 0) || (t->heads > 1 && t->head_stride % v != 0))
        return false;
    }
    return true;
  };
  int v = max_vec;
  while (v > 1 && !fits(v)) v /= 2;
  while (v > 1) {
    const lanes l = layout_of(heads, width, v);
    if (std::min(heads, 32 / l.per_head) * l.per_head >= 32) break;
    v /= 2;
  }
  return v;
}

// Calls f.template operator()<V, F>() for the vector width and the floats a lane holds of a head:
// V where a lane keeps one vector (no registers held for a second), else 4, or Wide for wider
// heads (up to 32 * Wide channels).
template <int Wide, class Fn>
void with_lanes(int vec, const lanes& l, std::string_view what, Fn&& f) {
  const bool narrow = l.chunks * vec <= 4;
  with_value<1, 2, 4, 8>(vec, what, [&]<int V>() {
    if constexpr (V < 4) {
      if (l.chunks == 1) {
        f.template operator()<V, V>();
        return;
      }
    }
    if constexpr (V <= 4) {
      if (narrow) {
        f.template operator()<V, 4>();
        return;
      }
    }
    f.template operator()<V, Wide>();
  });
}

template <int Bytes>
struct word;
template <>
struct word<16> {
  using type = uint4;
};
template <>
struct word<8> {
  using type = uint2;
};
template <>
struct word<4> {
  using type = unsigned;
};
template <>
struct word<2> {
  using type = unsigned short;
};

// f[0, V) = p[0, V) as floats, in loads of at most 16 bytes.
template <class T, int V>
__device__ __forceinline__ void load(const T* p, float* f) {
  constexpr int bytes = V * static_cast<int>(sizeof(T));
  if constexpr (bytes > 16) {
    constexpr int n = 16 / static_cast<int>(sizeof(T));
    load<T, n>(p, f);
    load<T, V - n>(p + n, f + n);
  } else {
    using W = typename word<bytes>::type;
    const W w = *reinterpret_cast<const W*>(p);
    T t[V];
    memcpy(t, &w, bytes);
#pragma unroll
    for (int v = 0; v < V; ++v) f[v] = convert<float>(t[v]);
  }
}

template <class T, int V>
__device__ __forceinline__ void store(T* p, const float* f) {
  constexpr int bytes = V * static_cast<int>(sizeof(T));
  if constexpr (bytes > 16) {
    constexpr int n = 16 / static_cast<int>(sizeof(T));
    store<T, n>(p, f);
    store<T, V - n>(p + n, f + n);
  } else {
    T t[V];
#pragma unroll
    for (int v = 0; v < V; ++v) t[v] = convert<T>(f[v]);
    typename word<bytes>::type w;
    memcpy(&w, t, bytes);
    *reinterpret_cast<typename word<bytes>::type*>(p) = w;
  }
}

// A [n, H, *] operand: data and element strides.
struct operand {
  const void* data = nullptr;
  std::int64_t row = 0, head = 0;
  template <class T>
  __device__ const T* at(std::int64_t r, int h) const {
    return static_cast<const T*>(data) + r * row + h * head;
  }
};
struct out_operand {
  void* data = nullptr;
  std::int64_t row = 0, head = 0;
  template <class T>
  __device__ T* at(std::int64_t r, int h) const {
    return static_cast<T*>(data) + r * row + h * head;
  }
};

inline operand in(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }
inline out_operand out_of(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }

// A lane's place: its vector slot in the head, its head (`load_head` is a valid one to read from
// where the warp's last group has fewer heads than lanes).
struct place {
  int sub, head, load_head;
  bool active;
};

__device__ __forceinline__ place place_of(const lanes& l, int group) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  place q;
  q.sub = lane & (l.per_head - 1);
  q.head = group * (32 / l.per_head) + lane / l.per_head;
  q.active = q.head < l.heads;
  q.load_head = q.active ? q.head : 0;
  return q;
}

// Loads the lane's vectors of the first `width` channels of a head's row (zeros past them).
template <class T, int V, int K>
__device__ __forceinline__ void load_row(const T* row, const lanes& l, int sub, int width,
                                         float (&v)[K][V]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * l.per_head + sub) * V;
    if (k < l.chunks && c < width) {
      load<T, V>(row + c, v[k]);
    } else {
#pragma unroll
      for (int x = 0; x < V; ++x) v[k][x] = 0.0f;
    }
  }
}

template <class T, int V, int K>
__device__ __forceinline__ void load_row(const T* row, const lanes& l, int sub, float (&v)[K][V]) {
  load_row<T, V, K>(row, l, sub, l.width, v);
}

template <class T, int V, int K>
__device__ __forceinline__ void store_row(T* row, const lanes& l, int sub, int width,
                                          const float (&v)[K][V]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * l.per_head + sub) * V;
    if (k < l.chunks && c < width) store<T, V>(row + c, v[k]);
  }
}

template <class T, int V, int K>
__device__ __forceinline__ void store_row(T* row, const lanes& l, int sub, const float (&v)[K][V]) {
  store_row<T, V, K>(row, l, sub, l.width, v);
}

// The sum over a head's lanes (each lane gets the same bits).
__device__ __forceinline__ float head_sum(float x, const lanes& l) {
  for (int o = 1; o < l.per_head; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int V, int K>
__device__ __forceinline__ float lane_dot(const float (&a)[K][V], const float (&b)[K][V]) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int x = 0; x < V; ++x) s = fmaf(a[k][x], b[k][x], s);
  return s;
}

}  // namespace trisparse::cuda::head_lanes
