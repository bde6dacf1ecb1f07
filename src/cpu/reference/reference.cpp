// Float64 oracles: plain loops, no tricks beyond max-subtraction in the softmax.
#include "trisparse/ops/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../../common/arguments.hpp"
#include "access.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"

namespace trisparse::reference {

using access::at;
using access::dot;
using access::put;

void sddmm(const csr_graph& a, const tensor_view& x, const tensor_view& y, const tensor_view& out,
           double scale) {
  a.check();
  check_view(x, "x", a.rows, -1, -1);
  check_view(y, "y", a.cols, x.heads, x.dim);
  check_view(out, "out", a.nnz(), x.heads, 1);
  // Rows on OpenMP threads here and below: each row writes only its own outputs, in the order one
  // thread would, so the result does not depend on the threads.
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
      const double w = a.has_values() ? a.values[e] : 1.0;
      for (std::int64_t h = 0; h < x.heads; ++h)
        put(out, e, h, 0, w * scale * dot(x, r, y, a.col_idx[e], h));
    }
  }
}

void softmax(const csr_graph& a, const tensor_view& scores, const tensor_view& out) {
  a.check();
  check_view(scores, "scores", a.nnz(), -1, 1);
  check_view(out, "out", a.nnz(), scores.heads, 1);
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t h = 0; h < scores.heads; ++h) {
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e)
        m = std::max(m, at(scores, e, h, 0));
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e)
        sum += std::exp(at(scores, e, h, 0) - m);
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
        put(out, e, h, 0, std::exp(at(scores, e, h, 0) - m) / sum);
      }
    }
  }
}

void spmm(const csr_graph& a, const tensor_view& w, const tensor_view& b, const tensor_view& c) {
  a.check();
  check_view(b, "b", a.cols, -1, -1);
  check_view(c, "c", a.rows, b.heads, b.dim);
  if (w.data != nullptr) check_view(w, "w", a.nnz(), b.heads, 1);
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t r = 0; r < a.rows; ++r) {
    std::vector<double> acc(static_cast<std::size_t>(b.dim));
    for (std::int64_t h = 0; h < b.heads; ++h) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
        const double x = w.data != nullptr ? at(w, e, h, 0) : a.has_values() ? a.values[e] : 1.0;
        for (std::int64_t d = 0; d < b.dim; ++d) acc[d] += x * at(b, a.col_idx[e], h, d);
      }
      for (std::int64_t d = 0; d < b.dim; ++d) put(c, r, h, d, acc[d]);
    }
  }
}

void attention(const csr_graph& a, const tensor_view& q, const tensor_view& k, const tensor_view& v,
               const tensor_view& out, double scale) {
  attention(a, q, k, v, out, scale, tensor_view{}, tensor_view{});
}

void attention(const csr_graph& a, const tensor_view& q, const tensor_view& k, const tensor_view& v,
               const tensor_view& out, double scale, const tensor_view& lse,
               const tensor_view& bias) {
  a.check();
  detail::check_attention_args(a.rows, a.cols, q, k, v, out, device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  if (lse.data != nullptr) check_view(lse, "lse", a.rows, q.heads, 1);
  if (bias.data != nullptr) detail::check_bias(bias, "bias", a.nnz(), q.heads, device_kind::cpu);
  csr_graph binary = a;
  binary.values.clear();  // attention uses the pattern only
  std::vector<double> s(binary.nnz() * q.heads), p(s.size());
  const auto edge_view = [&](std::vector<double>& buf) {
    return tensor_view::contiguous(buf.data(), dtype::f64, binary.nnz(), q.heads, 1);
  };
  const host_tensor q64 = access::as_f64(q), k64 = access::as_f64(k), v64 = access::as_f64(v);
  sddmm(binary, q64.view(), k64.view(), edge_view(s), scale);
  if (bias.data != nullptr) {
    for (std::int64_t e = 0; e < binary.nnz(); ++e)
      for (std::int64_t h = 0; h < q.heads; ++h)
        s[e * q.heads + h] += at(bias, e, detail::bias_head(bias, h), 0);
  }
  softmax(binary, edge_view(s), edge_view(p));
  spmm(binary, edge_view(p), v64.view(), out);
  if (lse.data == nullptr) return;
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t h = 0; h < q.heads; ++h) {
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e)
        m = std::max(m, s[e * q.heads + h]);
      for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e)
        sum += std::exp(s[e * q.heads + h] - m);
      put(lse, i, h, 0, a.degree(i) > 0 ? m + std::log(sum) : m);
    }
  }
}

namespace {

// Rows [row0, row0 + rows) of head h of t, as a one-head view.
tensor_view slice(const tensor_view& t, std::int64_t row0, std::int64_t rows, std::int64_t h) {
  tensor_view s = t;
  s.data = static_cast<char*>(t.data) +
           t.offset(row0, h, 0) * static_cast<std::int64_t>(size_of(t.type));
  s.rows = rows;
  s.heads = 1;
  return s;
}

// f(b, h) for every sequence b and head h, in order; each call's row loops run on OpenMP threads.
template <class F>
void for_each_sequence_head(std::int64_t batch, std::int64_t heads, const F& f) {
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h) f(b, h);
}

// The query and key blocks of the longest sequence (the block importance and bias layouts).
std::pair<std::int64_t, std::int64_t> most_blocks_of(const block_sparse_mask& mask) {
  std::int64_t qb = 0, kb = 0;
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    qb = std::max(qb, (mask.len_q(b) + mask.block - 1) / mask.block);
    kb = std::max(kb, (mask.len_k(b) + mask.block - 1) / mask.block);
  }
  return {qb, kb};
}

// The per-entry bias [nnz, 1, 1] of `pattern` (sequence b's expansion for head h) from a block
// bias: entry (i, j) takes block_bias[b * qb + i / G, h (0 if shared), j / G].
host_tensor entry_bias(const block_sparse_mask& mask, const csr_graph& pattern,
                       const tensor_view& block_bias, std::int64_t b, std::int64_t h,
                       std::int64_t qb) {
  host_tensor e(dtype::f64, pattern.nnz(), 1, 1);
  const std::int64_t hb = block_bias.heads == 1 ? 0 : h;
  for (std::int64_t i = 0; i < pattern.rows; ++i)
    for (std::int64_t x = pattern.row_ptr[i]; x < pattern.row_ptr[i + 1]; ++x)
      put(e.view(), x, 0, 0,
          at(block_bias, b * qb + i / mask.block, hb, pattern.col_idx[x] / mask.block));
  return e;
}

void check_block_bias_view(const block_sparse_mask& mask, const tensor_view& t, const char* what,
                           std::int64_t heads, bool shared_ok) {
  if (t.data == nullptr) return;
  const auto [qb, kb] = most_blocks_of(mask);
  check_view(t, what, mask.batch() * qb, shared_ok && t.heads == 1 ? 1 : heads, kb);
}

}  // namespace

void block_sparse_attention(const block_sparse_mask& mask, const tensor_view& q,
                            const tensor_view& k, const tensor_view& v, const tensor_view& out,
                            double scale, const tensor_view& block_bias) {
  mask.check();
  detail::check_attention_args(mask.cu_seqlens_q.back(), mask.cu_seqlens_k.back(), q, k, v, out,
                               device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(mask.heads == 1 || mask.heads == q.heads,
                          "the mask has " + std::to_string(mask.heads) + " heads, q " +
                              std::to_string(q.heads) + " (a mask is per head or shared)");
  check_block_bias_view(mask, block_bias, "block_bias", q.heads, true);
  const std::int64_t qb = most_blocks_of(mask).first;
  for_each_sequence_head(mask.batch(), q.heads, [&](std::int64_t b, std::int64_t h) {
    const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
    const csr_graph pattern = mask.expand(b, h);
    const host_tensor bias = block_bias.data != nullptr
                                 ? entry_bias(mask, pattern, block_bias, b, h, qb)
                                 : host_tensor{};
    attention(pattern, slice(q, q0, mask.len_q(b), h), slice(k, k0, mask.len_k(b), h),
              slice(v, k0, mask.len_k(b), h), slice(out, q0, mask.len_q(b), h), scale, {},
              block_bias.data != nullptr ? bias.view() : tensor_view{});
  });
}

void block_sparse_attention_backward(const block_sparse_mask& mask, const tensor_view& q,
                                     const tensor_view& k, const tensor_view& v,
                                     const tensor_view& dout, const tensor_view& dq,
                                     const tensor_view& dk, const tensor_view& dv, double scale,
                                     const tensor_view& block_bias,
                                     const tensor_view& dblock_bias) {
  mask.check();
  const std::int64_t rows = mask.cu_seqlens_q.back(), cols = mask.cu_seqlens_k.back();
  detail::check_attention_args(rows, cols, q, k, v, dout, device_kind::cpu);
  check_view(dq, "dq", rows, q.heads, q.dim);
  check_view(dk, "dk", cols, q.heads, q.dim);
  check_view(dv, "dv", cols, q.heads, v.dim);
  TRISPARSE_EXPECTS_INPUT(mask.heads == 1 || mask.heads == q.heads,
                          "the mask has " + std::to_string(mask.heads) + " heads, q " +
                              std::to_string(q.heads) + " (a mask is per head or shared)");
  check_block_bias_view(mask, block_bias, "block_bias", q.heads, true);
  check_block_bias_view(mask, dblock_bias, "dblock_bias", q.heads, false);
  TRISPARSE_EXPECTS_INPUT(dblock_bias.data == nullptr || block_bias.data != nullptr,
                          "dblock_bias needs the block_bias");
  const std::int64_t qb = most_blocks_of(mask).first, g = mask.block;
  for_each_sequence_head(mask.batch(), q.heads, [&](std::int64_t b, std::int64_t h) {
    const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
    const std::int64_t lq = mask.len_q(b), lk = mask.len_k(b);
    const csr_graph pattern = mask.expand(b, h);
    const bool biased = block_bias.data != nullptr;
    const host_tensor bias =
        biased ? entry_bias(mask, pattern, block_bias, b, h, qb) : host_tensor{};
    host_tensor ds(dtype::f64, dblock_bias.data != nullptr ? pattern.nnz() : 0, 1, 1);
    attention_backward(pattern, slice(q, q0, lq, h), slice(k, k0, lk, h), slice(v, k0, lk, h),
                       slice(dout, q0, lq, h), slice(dq, q0, lq, h), slice(dk, k0, lk, h),
                       slice(dv, k0, lk, h), scale, ds.rows() > 0 ? ds.view() : tensor_view{},
                       biased ? bias.view() : tensor_view{});
    if (ds.rows() == 0) return;
    // dB: each kept block's entries summed (kept blocks without a pair give 0).
    const csr_graph& blocks = mask.at(b, h).blocks;
    for (std::int64_t r = 0; r < blocks.rows; ++r)
      for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e)
        put(dblock_bias, b * qb + r, h, blocks.col_idx[e], 0.0);
    for (std::int64_t i = 0; i < pattern.rows; ++i)
      for (std::int64_t x = pattern.row_ptr[i]; x < pattern.row_ptr[i + 1]; ++x) {
        const std::int64_t r = b * qb + i / g, c = pattern.col_idx[x] / g;
        put(dblock_bias, r, h, c, at(dblock_bias, r, h, c) + at(ds.view(), x, 0, 0));
      }
  });
}

void block_importance(const block_sparse_mask& mask, const tensor_view& q, const tensor_view& k,
                      const tensor_view& v, const tensor_view& dout, double scale,
                      const tensor_view& block_mass, const tensor_view& block_grad) {
  mask.check();
  const std::int64_t rows = mask.cu_seqlens_q.back(), g = mask.block;
  detail::check_attention_args(rows, mask.cu_seqlens_k.back(), q, k, v, dout, device_kind::cpu);
  // Named variables (not a structured binding): the lambda below captures them.
  const std::pair<std::int64_t, std::int64_t> most = most_blocks_of(mask);
  const std::int64_t qb = most.first, kb = most.second;
  for (const auto& [t, what] : {std::pair{&block_mass, "block_mass"}, {&block_grad, "block_grad"}})
    if (t->data != nullptr) check_view(*t, what, mask.batch() * qb, q.heads, kb);
  for_each_sequence_head(mask.batch(), q.heads, [&](std::int64_t b, std::int64_t h) {
    const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
    const std::int64_t lq = mask.len_q(b), lk = mask.len_k(b);
    const csr_graph pattern = mask.expand(b, h);
    const tensor_view qs = slice(q, q0, lq, h), ks = slice(k, k0, lk, h);
    // P from the row's lse, dS from the reference backward, both per entry of the expansion.
    host_tensor out(dtype::f64, lq, 1, v.dim), lse(dtype::f64, lq, 1, 1),
        ds(dtype::f64, pattern.nnz(), 1, 1), dq(dtype::f64, lq, 1, q.dim),
        dk(dtype::f64, lk, 1, q.dim), dv(dtype::f64, lk, 1, v.dim);
    attention(pattern, qs, ks, slice(v, k0, lk, h), out.view(), scale, lse.view());
    attention_backward(pattern, qs, ks, slice(v, k0, lk, h), slice(dout, q0, lq, h), dq.view(),
                       dk.view(), dv.view(), scale, ds.view());
    std::vector<double> mass(static_cast<std::size_t>(qb * kb), 0.0), grad(mass.size(), 0.0);
    for (std::int64_t i = 0; i < lq; ++i) {
      for (std::int64_t e = pattern.row_ptr[i]; e < pattern.row_ptr[i + 1]; ++e) {
        const std::int64_t j = pattern.col_idx[e], block = (i / g) * kb + j / g;
        mass[block] += std::exp(scale * dot(qs, i, ks, j, 0) - lse.get(i));
        grad[block] += std::abs(ds.get(e));
      }
    }
    const csr_graph& kept = mask.at(b, h).blocks;
    for (std::int64_t r = 0; r < kept.rows; ++r) {
      const auto block_rows = static_cast<double>(std::min(g, lq - r * g));
      for (std::int64_t e = kept.row_ptr[r]; e < kept.row_ptr[r + 1]; ++e) {
        const std::int64_t c = kept.col_idx[e];
        if (block_mass.data != nullptr)
          put(block_mass, b * qb + r, h, c, mass[r * kb + c] / block_rows);
        if (block_grad.data != nullptr) put(block_grad, b * qb + r, h, c, grad[r * kb + c]);
      }
    }
  });
}

void blocked_attention(const bsb& f, const tensor_view& q, const tensor_view& k,
                       const tensor_view& v, const tensor_view& out, double scale) {
  f.check();
  detail::check_attention_args(f.rows, f.cols, q, k, v, out, device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  constexpr int kR = bsb::kRowWindow;
  const int c_max = f.tcb_cols;
  std::vector<double> acc(v.dim), block(c_max);
  for (const std::int32_t w : f.window_order) {
    for (int r = 0; r < kR && w * kR + r < f.rows; ++r) {
      const std::int64_t row = std::int64_t{w} * kR + r;
      for (std::int64_t h = 0; h < q.heads; ++h) {
        double m = -std::numeric_limits<double>::infinity(), l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t t = f.tcb_offset[w]; t < f.tcb_offset[w + 1]; ++t) {
          // One tensor-core block: scores under the bitmap, then one rescale per block.
          double block_max = -std::numeric_limits<double>::infinity();
          for (int c = 0; c < c_max; ++c) {
            if (!f.test(t, r, c)) continue;
            block[c] = scale * dot(q, row, k, f.col_idx[t * c_max + c], h);
            block_max = std::max(block_max, block[c]);
          }
          if (block_max == -std::numeric_limits<double>::infinity()) continue;
          const double m_new = std::max(m, block_max);
          const double correction = std::exp(m - m_new);  // exp(-inf) = 0 on the first block
          l *= correction;
          for (auto& x : acc) x *= correction;
          m = m_new;
          for (int c = 0; c < c_max; ++c) {
            if (!f.test(t, r, c)) continue;
            const double e = std::exp(block[c] - m);
            l += e;
            const std::int64_t col = f.col_idx[t * c_max + c];
            for (std::int64_t d = 0; d < v.dim; ++d) acc[d] += e * at(v, col, h, d);
          }
        }
        for (std::int64_t d = 0; d < v.dim; ++d) put(out, row, h, d, l > 0 ? acc[d] / l : 0.0);
      }
    }
  }
}

}  // namespace trisparse::reference
