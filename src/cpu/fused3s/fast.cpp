// The CPU engine's fused attention: fp32, OpenMP over rows, online softmax per chunk of neighbours.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <vector>

#include "../../ops/arguments.hpp"
#include "fast.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/cpu.hpp"

namespace trisparse::cpu {

namespace {

// fp32 operand: the caller's buffer when it already is f32, else a packed converted copy.
struct f32_operand {
  const float* data = nullptr;
  std::int64_t row_stride = 0, head_stride = 0;
  std::vector<float> owned;
};

f32_operand as_f32(const tensor_view& t) {
  f32_operand o;
  if (t.type == dtype::f32) {
    o.data = static_cast<const float*>(t.data);
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
            static_cast<float>(load_as_double(t.data, t.type, t.offset(r, h, d)));
      }
    }
  }
  o.data = o.owned.data();
  o.row_stride = t.heads * t.dim;
  o.head_stride = t.dim;
  return o;
}

constexpr std::int64_t kChunk = 64;    // neighbours per online-softmax step
constexpr std::int64_t kPrefetch = 4;  // neighbours ahead whose K/V rows are prefetched

// Gathered rows are random DRAM accesses: ask for every cache line of a row ahead of use.
inline void prefetch_row(const float* p, std::int64_t n) {
  for (std::int64_t d = 0; d < n; d += 16) __builtin_prefetch(p + d);
}

}  // namespace

void fused_attention_unchecked(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                               const tensor_view& v, const tensor_view& out, float scale) {
  detail::check_attention_args(a.rows, a.cols, q, k, v, out, device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  const f32_operand qf = as_f32(q), kf = as_f32(k), vf = as_f32(v);
  const std::int64_t heads = q.heads, dk = q.dim, dv = v.dim;
  // exp(x) = exp2(x * log2 e): fold log2 e into the scale once.
  const float scale2 = scale * std::numbers::log2e_v<float>;
  const bool out_f32 = out.type == dtype::f32;

#pragma omp parallel
  {
    std::vector<float> qrow(dk), acc(dv), s(kChunk);
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      const std::int64_t e0 = a.row_ptr[i], e1 = a.row_ptr[i + 1];
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* qp = qf.data + i * qf.row_stride + h * qf.head_stride;
        for (std::int64_t d = 0; d < dk; ++d) qrow[d] = qp[d] * scale2;
        std::fill(acc.begin(), acc.end(), 0.0f);
        float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
        for (std::int64_t c0 = e0; c0 < e1; c0 += kChunk) {
          const std::int64_t n = std::min(kChunk, e1 - c0);
          float chunk_max = -std::numeric_limits<float>::infinity();
          for (std::int64_t j = 0; j < n; ++j) {
            // K ahead for this loop; V of this neighbour for the accumulation loop below.
            if (j + kPrefetch < n) {
              prefetch_row(kf.data + std::int64_t{a.col_idx[c0 + j + kPrefetch]} * kf.row_stride +
                               h * kf.head_stride,
                           dk);
            }
            prefetch_row(
                vf.data + std::int64_t{a.col_idx[c0 + j]} * vf.row_stride + h * vf.head_stride, dv);
            const float* kp =
                kf.data + std::int64_t{a.col_idx[c0 + j]} * kf.row_stride + h * kf.head_stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (std::int64_t d = 0; d < dk; ++d) dot += qrow[d] * kp[d];
            s[j] = dot;
            chunk_max = std::max(chunk_max, dot);
          }
          if (chunk_max > m) {  // rescale the running state once per chunk
            const float correction = std::exp2(m - chunk_max);
            l *= correction;
#pragma omp simd
            for (std::int64_t d = 0; d < dv; ++d) acc[d] *= correction;
            m = chunk_max;
          }
          for (std::int64_t j = 0; j < n; ++j) {
            const float p = std::exp2(s[j] - m);
            l += p;
            const float* vp =
                vf.data + std::int64_t{a.col_idx[c0 + j]} * vf.row_stride + h * vf.head_stride;
#pragma omp simd
            for (std::int64_t d = 0; d < dv; ++d) acc[d] += p * vp[d];
          }
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // empty row: zeros, never NaN
        if (out_f32) {
          float* op = static_cast<float*>(out.data) + out.offset(i, h, 0);
          for (std::int64_t d = 0; d < dv; ++d) op[d] = acc[d] * inv;
        } else {
          for (std::int64_t d = 0; d < dv; ++d)
            store_from_double(out.data, out.type, out.offset(i, h, d), acc[d] * inv);
        }
      }
    }
  }
}

void fused_attention(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                     const tensor_view& v, const tensor_view& out, float scale) {
  a.check();
  fused_attention_unchecked(a, q, k, v, out, scale);
}

}  // namespace trisparse::cpu
