// GAT's attention: the fp32 CPU engine (gat.hpp).
#include "gat.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "f32.hpp"

namespace trisparse::cpu {

namespace {

float keep_of(const gat_keep& k, std::int64_t e, std::int64_t h) {
  if (k.keep.data == nullptr) return 1.0f;
  return *f32_at(k.keep, k.index != nullptr ? k.index[e] : e, h);
}

float leaky(float s, float slope) { return s > 0.0f ? s : s * slope; }

// Row i's pre-activation scores a_dst[i, h] + a_src[j, h], entry-major ([n, H]).
void scores(const csr_graph& g, const tensor_view& a_src, const tensor_view& a_dst, std::int64_t i,
            std::vector<float>& s) {
  const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0, heads = a_dst.heads;
  s.resize(static_cast<std::size_t>(n * heads));
  for (std::int64_t k = 0; k < n; ++k)
    for (std::int64_t h = 0; h < heads; ++h)
      s[k * heads + h] = *f32_at(a_dst, i, h) + *f32_at(a_src, g.col_idx[e0 + k], h);
}

}  // namespace

void gat_forward(const csr_graph& g, const tensor_view& x, const tensor_view& a_src,
                 const tensor_view& a_dst, const gat_keep& keep, float negative_slope,
                 const tensor_view& out, const tensor_view& lse) {
  const std::int64_t heads = x.heads, width = x.dim;
#pragma omp parallel
  {
    std::vector<float> w, m(static_cast<std::size_t>(heads)), l(m.size());
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0;
      scores(g, a_src, a_dst, i, w);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t h = 0; h < heads; ++h)
          m[h] = std::max(m[h], w[k * heads + h] = leaky(w[k * heads + h], negative_slope));
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t h = 0; h < heads; ++h)
          l[h] += w[k * heads + h] = std::exp(w[k * heads + h] - m[h]);
      for (std::int64_t h = 0; h < heads; ++h) {
        std::fill_n(f32_at(out, i, h), width, 0.0f);
        if (lse.data != nullptr)
          *f32_at(lse, i, h) =
              n > 0 ? m[h] + std::log(l[h]) : -std::numeric_limits<float>::infinity();
      }
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t j = g.col_idx[e0 + k];
        for (std::int64_t h = 0; h < heads; ++h) {
          const float wk = w[k * heads + h] / l[h] * keep_of(keep, e0 + k, h);
          const float* xj = f32_at(x, j, h);
          float* o = f32_at(out, i, h);
          for (std::int64_t c = 0; c < width; ++c) o[c] += wk * xj[c];
        }
      }
    }
  }
}

void gat_backward(const csr_graph& g, const detail::transposed_pattern& t, const tensor_view& x,
                  const tensor_view& a_src, const tensor_view& a_dst, const gat_keep& keep,
                  float negative_slope, const tensor_view& lse, const tensor_view& dout,
                  const tensor_view& dx, const tensor_view& da_src, const tensor_view& da_dst) {
  const std::int64_t heads = x.heads, width = x.dim;
  // Per entry and head: the weight p keep that dx takes, and de = dL/d(a_dst + a_src).
  std::vector<float> weight(static_cast<std::size_t>(g.nnz() * heads)), de(weight.size());
#pragma omp parallel
  {
    std::vector<float> s, dp;
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0;
      scores(g, a_src, a_dst, i, s);
      dp.resize(s.size());
      for (std::int64_t h = 0; h < heads; ++h) {
        // out_i = sum_k p_k keep_k x_k: dL/dp_k = keep_k <dout_i, x_k>; the softmax's gradient
        // p_k (dp_k - sum_q p_q dp_q); LeakyReLU's slope below 0.
        const float li = *f32_at(lse, i, h);
        const float* gi = f32_at(dout, i, h);
        float mean = 0.0f;
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t e = e0 + k;
          const float* xj = f32_at(x, g.col_idx[e], h);
          float d = 0.0f;
          for (std::int64_t c = 0; c < width; ++c) d += gi[c] * xj[c];
          const float p = std::exp(leaky(s[k * heads + h], negative_slope) - li),
                      kp = keep_of(keep, e, h);
          dp[k * heads + h] = kp * d;
          weight[e * heads + h] = p * kp;
          de[e * heads + h] = p;
          mean += p * kp * d;
        }
        float sum = 0.0f;
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t e = e0 + k;
          const float v = de[e * heads + h] * (dp[k * heads + h] - mean) *
                          (s[k * heads + h] > 0.0f ? 1.0f : negative_slope);
          de[e * heads + h] = v;
          sum += v;
        }
        *f32_at(da_dst, i, h) = sum;
      }
    }
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t j = 0; j < g.cols; ++j) {
      for (std::int64_t h = 0; h < heads; ++h) {
        std::fill_n(f32_at(dx, j, h), width, 0.0f);
        *f32_at(da_src, j, h) = 0.0f;
      }
      for (std::int64_t q = t.col_ptr[j]; q < t.col_ptr[j + 1]; ++q) {
        const std::int64_t e = t.entry[q], i = t.row_idx[q];
        for (std::int64_t h = 0; h < heads; ++h) {
          const float wk = weight[e * heads + h];
          const float* gi = f32_at(dout, i, h);
          float* d = f32_at(dx, j, h);
          for (std::int64_t c = 0; c < width; ++c) d[c] += wk * gi[c];
          *f32_at(da_src, j, h) += de[e * heads + h];
        }
      }
    }
  }
}

}  // namespace trisparse::cpu
