#pragma once
// The CPU engines' shared pieces: operands in the engine's type (fp32, or float64 for float64
// inputs), and one query row's online softmax over chunks of
// keys (running max m, running sum l, accumulator acc), in exp2 with log2 e folded into the scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <vector>

#include "compute_type.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cpu {

/// An operand in the engine's type T (float, or double for float64 inputs): the caller's buffer
/// when it already holds T, else a packed converted copy.
template <class T>
struct operand {
  const T* data = nullptr;
  std::int64_t row_stride = 0, head_stride = 0;
  std::vector<T> owned;
  const T* row(std::int64_t r, std::int64_t h) const {
    return data + r * row_stride + h * head_stride;
  }
};
using f32_operand = operand<float>;

template <class T>
operand<T> as_operand(const tensor_view& t) {
  operand<T> o;
  if (t.type == dtype_of<T>) {
    o.data = static_cast<const T*>(t.data);
    o.row_stride = t.row_stride;
    o.head_stride = t.head_stride;
    return o;
  }
  o.owned.resize(static_cast<std::size_t>(t.numel()));
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < t.rows; ++r) {
    for (std::int64_t h = 0; h < t.heads; ++h) {
      for (std::int64_t d = 0; d < t.dim; ++d) {
        o.owned[(r * t.heads + h) * t.dim + d] =
            static_cast<T>(load_as_double(t.data, t.type, t.offset(r, h, d)));
      }
    }
  }
  o.data = o.owned.data();
  o.row_stride = t.heads * t.dim;
  o.head_stride = t.dim;
  return o;
}
inline f32_operand as_f32(const tensor_view& t) { return as_operand<float>(t); }

constexpr std::int64_t kChunk = 64;    // keys per online-softmax step
constexpr std::int64_t kPrefetch = 4;  // keys ahead whose K rows are prefetched

// Gathered rows are random DRAM accesses: ask for every cache line of a row ahead of use.
template <class T>
void prefetch_row(const T* p, std::int64_t n) {
  for (std::int64_t d = 0; d < n; d += 64 / static_cast<std::int64_t>(sizeof(T)))
    __builtin_prefetch(p + d);
}

/// One query row's running softmax state.
template <class T = float>
struct row_state {
  T m = -std::numeric_limits<T>::infinity(), l = 0;
  std::vector<T> acc, s;
  explicit row_state(std::int64_t dv) : acc(static_cast<std::size_t>(dv)), s(kChunk) {}
  void reset() {
    m = -std::numeric_limits<T>::infinity();
    l = 0;
    std::fill(acc.begin(), acc.end(), T{0});
  }
};

/// No score bias (attend_chunk's default).
struct no_bias {
  float operator()(std::int64_t) const { return 0.0f; }
};

/// Every key kept (attend_chunk's default: no dropout).
struct keep_all {
  float operator()(std::int64_t) const { return 1.0f; }
};

/// Attends qrow (already scaled by scale * log2 e) to n <= kChunk keys, key j at row key_row(j)
/// of k and v (head h), its score plus key_bias(j) (in log2 units): one rescale of the state per
/// chunk. key_keep(j): the factor on key j's weight in the output, not in the normaliser
/// (attention dropout).
template <class T, class KeyRow, class KeyBias = no_bias, class KeyKeep = keep_all>
inline void attend_chunk(const T* qrow, std::int64_t n, KeyRow key_row, const operand<T>& kf,
                         const operand<T>& vf, std::int64_t h, std::int64_t dk, std::int64_t dv,
                         row_state<T>& st, KeyBias key_bias = {}, KeyKeep key_keep = {}) {
  T chunk_max = -std::numeric_limits<T>::infinity();
  for (std::int64_t j = 0; j < n; ++j) {
    // K ahead for this loop; V of this key for the accumulation loop below.
    if (j + kPrefetch < n) prefetch_row(kf.row(key_row(j + kPrefetch), h), dk);
    prefetch_row(vf.row(key_row(j), h), dv);
    const T* kp = kf.row(key_row(j), h);
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t d = 0; d < dk; ++d) dot += qrow[d] * kp[d];
    dot += key_bias(j);
    st.s[j] = dot;
    chunk_max = std::max(chunk_max, dot);
  }
  if (chunk_max > st.m) {  // rescale the running state once per chunk
    const T correction = std::exp2(st.m - chunk_max);
    st.l *= correction;
#pragma omp simd
    for (std::int64_t d = 0; d < dv; ++d) st.acc[d] *= correction;
    st.m = chunk_max;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    const T p = std::exp2(st.s[j] - st.m);
    st.l += p;
    const T w = p * static_cast<T>(key_keep(j));
    const T* vp = vf.row(key_row(j), h);
#pragma omp simd
    for (std::int64_t d = 0; d < dv; ++d) st.acc[d] += w * vp[d];
  }
}

/// out[i, h, :] = acc / l (zeros for a row that saw no key, never NaN).
template <class T>
void store_row(const row_state<T>& st, const tensor_view& out, std::int64_t i, std::int64_t h) {
  const T inv = st.l > T{0} ? T{1} / st.l : T{0};
  const std::int64_t dv = out.dim;
  if (out.type == dtype::f32) {
    float* op = static_cast<float*>(out.data) + out.offset(i, h, 0);
    for (std::int64_t d = 0; d < dv; ++d) op[d] = static_cast<float>(st.acc[d] * inv);
  } else {
    for (std::int64_t d = 0; d < dv; ++d)
      store_from_double(out.data, out.type, out.offset(i, h, d), st.acc[d] * inv);
  }
}

/// The row's log-sum-exp in natural log, from a state whose scores were scaled by log2 e
/// (-inf for a row that saw no key).
template <class T>
T row_lse(const row_state<T>& st) {
  return st.l > T{0} ? (st.m + std::log2(st.l)) * std::numbers::ln2_v<T>
                     : -std::numeric_limits<T>::infinity();
}

/// Writes x to element (r, h, d) of t in t's dtype.
inline void store_value(const tensor_view& t, std::int64_t r, std::int64_t h, std::int64_t d,
                        double x) {
  if (t.type == dtype::f32)
    static_cast<float*>(t.data)[t.offset(r, h, d)] = static_cast<float>(x);
  else
    store_from_double(t.data, t.type, t.offset(r, h, d), x);
}

}  // namespace trisparse::cpu
