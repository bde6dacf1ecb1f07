// The CPU engine's block-sparse attention in tiles (fp32, no dropout): a query block's rows
// against 64-key chunks of its kept key blocks as small matrix products in registers (the AVX2 +
// FMA clones: 4 rows x 16 keys for the scores, 2 rows x 32 channels for the weighted sums), the
// online softmax between them. The backward recomputes P from the forward's lse in two passes
// with no shared writes: dq per query block (over its kept blocks), dk and dv per 64-key chunk
// (over the query blocks that keep its block, the transposed lists). Operands are copied into
// per-thread tiles padded with zeros (rows to 4, channels to 8, keys to 16), so any head dim and
// block size work and the products never branch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <vector>

#include "../common/exp2.hpp"
#include "../common/online_softmax.hpp"
#include "../common/simd.hpp"
#include "engine.hpp"

namespace trisparse::cpu {

namespace {

constexpr std::int64_t kKeys = 64;  // keys a chunk (the score tiles' width)
constexpr float kInf = std::numeric_limits<float>::infinity();

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

/// C[i, 0:n) = sum over t < depth of A[i, t] * B[t, 0:n) for i < rows (a multiple of 4), n a
/// multiple of 16 (B's row stride kKeys): the scores of A's rows against B's columns.
[[gnu::target_clones("arch=x86-64-v3", "default")]] void product_tiles(
    const float* a, std::int64_t lda, std::int64_t rows, std::int64_t depth, const float* b,
    std::int64_t n, float* c) {
  for (std::int64_t i0 = 0; i0 < rows; i0 += 4) {
    for (std::int64_t j0 = 0; j0 < n; j0 += 16) {
      v8 acc[4][2] = {};
      for (std::int64_t t = 0; t < depth; ++t) {
        v8 b0, b1;
        std::memcpy(&b0, b + t * kKeys + j0, sizeof b0);
        std::memcpy(&b1, b + t * kKeys + j0 + 8, sizeof b1);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const float x = a[(i0 + r) * lda + t];
          acc[r][0] += x * b0;
          acc[r][1] += x * b1;
        }
      }
      for (int r = 0; r < 4; ++r) std::memcpy(c + (i0 + r) * kKeys + j0, acc[r], sizeof acc[r]);
    }
  }
}

template <int V>
[[gnu::always_inline]] inline void accumulate_tile(const float* w, std::int64_t ldw,
                                                   std::int64_t terms, const float* b,
                                                   std::int64_t ldb, float* c0, float* c1) {
  v8 acc[2][V];
  std::memcpy(acc[0], c0, sizeof acc[0]);
  std::memcpy(acc[1], c1, sizeof acc[1]);
  for (std::int64_t t = 0; t < terms; ++t) {
    const float w0 = w[t], w1 = w[ldw + t];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      v8 x;
      std::memcpy(&x, b + t * ldb + 8 * v, sizeof x);
      acc[0][v] += w0 * x;
      acc[1][v] += w1 * x;
    }
  }
  std::memcpy(c0, acc[0], sizeof acc[0]);
  std::memcpy(c1, acc[1], sizeof acc[1]);
}

/// C[i, 0:cols) += sum over t < terms of W[i, t] * B[t, 0:cols) for i < rows (a multiple of 2),
/// cols a multiple of 8: weighted sums of B's rows.
[[gnu::target_clones("arch=x86-64-v3", "default")]] void accumulate_tiles(
    const float* w, std::int64_t ldw, std::int64_t rows, std::int64_t terms, const float* b,
    std::int64_t ldb, std::int64_t cols, float* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < rows; i += 2) {
    const float* wi = w + i * ldw;
    float* ci = c + i * ldc;
    std::int64_t d = 0;
    for (; d + 32 <= cols; d += 32)
      accumulate_tile<4>(wi, ldw, terms, b + d, ldb, ci + d, ci + ldc + d);
    switch ((cols - d) / 8) {
      case 3:
        accumulate_tile<3>(wi, ldw, terms, b + d, ldb, ci + d, ci + ldc + d);
        break;
      case 2:
        accumulate_tile<2>(wi, ldw, terms, b + d, ldb, ci + d, ci + ldc + d);
        break;
      case 1:
        accumulate_tile<1>(wi, ldw, terms, b + d, ldb, ci + d, ci + ldc + d);
        break;
      default:
        break;
    }
  }
}

/// rows x cols of `from` (any float type; row r, head h) into `to` (row stride ld, zeros past
/// rows and cols up to `rows_to`, `ld`), times `factor`.
void load_tile(const operand<float>& from, std::int64_t row0, std::int64_t rows, std::int64_t h,
               std::int64_t cols, float factor, std::int64_t rows_to, std::int64_t ld, float* to) {
  for (std::int64_t r = 0; r < rows_to; ++r) {
    float* t = to + r * ld;
    if (r < rows) {
      const float* f = from.row(row0 + r, h);
      for (std::int64_t d = 0; d < cols; ++d) t[d] = f[d] * factor;
      std::fill(t + cols, t + ld, 0.0f);
    } else {
      std::fill(t, t + ld, 0.0f);
    }
  }
}

/// The transpose of rows [row0, row0 + n) (cols channels) into to[d * kKeys + j], zeros past n
/// and cols up to cols_to.
void load_transposed(const operand<float>& from, std::int64_t row0, std::int64_t n, std::int64_t h,
                     std::int64_t cols, std::int64_t cols_to, float* to) {
  std::fill(to, to + cols_to * kKeys, 0.0f);
  for (std::int64_t j = 0; j < n; ++j) {
    const float* f = from.row(row0 + j, h);
    for (std::int64_t d = 0; d < cols; ++d) to[d * kKeys + j] = f[d];
  }
}

void store_tile(const tensor_view& t, std::int64_t row0, std::int64_t rows, std::int64_t h,
                const float* from, std::int64_t ld, float factor) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* f = from + r * ld;
    if (t.type == dtype::f32) {
      float* o = static_cast<float*>(t.data) + t.offset(row0 + r, h, 0);
      for (std::int64_t d = 0; d < t.dim; ++d) o[d] = f[d] * factor;
    } else {
      for (std::int64_t d = 0; d < t.dim; ++d)
        store_from_double(t.data, t.type, t.offset(row0 + r, h, d), double{f[d] * factor});
    }
  }
}

/// What one task's tiles need, sized once a thread for the mask's block.
struct tiles {
  std::int64_t dk, dv, rows;  // padded channels and rows
  std::vector<float> q, o, kt, vt, k, v, s, p, dp, acc, acc2, m, l, lse2, delta;
  tiles(std::int64_t dk_, std::int64_t dv_, std::int64_t block)
      : dk(round_up(dk_, 8)), dv(round_up(dv_, 8)), rows(round_up(block, 4)) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    const std::int64_t wide = std::max(rows, kKeys);
    q.resize(n(wide * dk));
    o.resize(n(wide * dv));
    kt.resize(n(dk * kKeys));
    vt.resize(n(dv * kKeys));
    k.resize(n(kKeys * dk));
    v.resize(n(kKeys * dv));
    s.resize(n(wide * wide));
    p.resize(n(wide * wide));
    dp.resize(n(wide * kKeys));
    acc.resize(n(wide * std::max(dk, dv)));
    acc2.resize(n(wide * std::max(dk, dv)));
    m.resize(n(rows));
    l.resize(n(rows));
    lse2.resize(n(rows));
    delta.resize(n(rows));
  }
};

/// The (sequence, unit, head) tasks of a pass: query blocks (forward, dq) or chunks of up to 64
/// keys within a key block (dk, dv).
struct task_list {
  std::vector<std::int64_t> seq, first;  // per unit: its sequence and first row
  std::int64_t heads;
  std::int64_t size() const { return static_cast<std::int64_t>(seq.size()) * heads; }
};

task_list units_of(const block_sparse_mask& mask, std::int64_t heads, bool keys) {
  task_list t{{}, {}, heads};
  const std::int64_t g = mask.block, step = keys ? std::min(g, kKeys) : g;
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    const std::int64_t len = keys ? mask.len_k(b) : mask.len_q(b);
    for (std::int64_t block0 = 0; block0 < len; block0 += g) {
      for (std::int64_t r = block0; r < std::min(block0 + g, len); r += step) {
        t.seq.push_back(b);
        t.first.push_back(r);
      }
    }
  }
  return t;
}

/// Masks a row's scores from key `keys` on (the chunk's keys past the row's last) and returns
/// their maximum (-inf: none left).
[[gnu::target_clones("arch=x86-64-v3", "default")]] float mask_row(float* s, std::int64_t n_pad,
                                                                   std::int64_t keys) {
  float top = -kInf;
#pragma omp simd reduction(max : top)
  for (std::int64_t j = 0; j < n_pad; ++j) {
    s[j] = j < keys ? s[j] : -kInf;
    top = std::max(top, s[j]);
  }
  return top;
}

/// One row's online-softmax step over a chunk: p = 2^(s - m') with m' = max(m, top), the running
/// sum l rescaled and grown; returns the factor the row's accumulator takes (2^(m - m')).
[[gnu::target_clones("arch=x86-64-v3", "default")]] float softmax_step(const float* s,
                                                                       std::int64_t n, float top,
                                                                       float& m, float& l,
                                                                       float* p) {
  const float next = std::max(m, top);
  const float correction = exp2_nonpositive(m - next);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < n; ++j) {
    p[j] = exp2_nonpositive(s[j] - next);
    sum += p[j];
  }
  l = l * correction + sum;
  m = next;
  return correction;
}

/// A backward row: p = 2^(s - lse2) and, in s, dS = p (dp - delta).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void gradient_row(float* s, const float* dp,
                                                                      std::int64_t n, float lse2,
                                                                      float delta, float* p) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) {
    p[j] = exp2_nonpositive(s[j] - lse2);
    s[j] = p[j] * (dp[j] - delta);
  }
}

}  // namespace

bool blocked_engine_takes(const tensor_view& q, const attention_dropout& dropout) {
  return q.type != dtype::f64 && dropout.p == 0;
}

void block_sparse_forward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                  const tensor_view& k, const tensor_view& v,
                                  const tensor_view& out, double scale, const tensor_view& lse) {
  const operand<float> qf = as_operand<float>(q), kf = as_operand<float>(k),
                       vf = as_operand<float>(v);
  const std::int64_t heads = q.heads, dk = q.dim, dv = v.dim, g = mask.block;
  const float scale2 = static_cast<float>(scale) * std::numbers::log2e_v<float>;
  const task_list tasks = units_of(mask, heads, false);
#pragma omp parallel
  {
    tiles w(dk, dv, g);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks.size(); ++task) {
      const std::int64_t b = tasks.seq[task / heads], i0 = tasks.first[task / heads];
      const std::int64_t h = task % heads, r = i0 / g;
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const std::int64_t rows = std::min(g, mask.len_q(b) - i0), rows4 = round_up(rows, 4);
      load_tile(qf, q0 + i0, rows, h, dk, scale2, rows4, w.dk, w.q.data());
      std::fill(w.acc.begin(), w.acc.begin() + rows4 * w.dv, 0.0f);
      std::fill(w.m.begin(), w.m.end(), -kInf);
      std::fill(w.l.begin(), w.l.end(), 0.0f);
      const std::int64_t last_row = mask.last_key(b, i0 + rows - 1);  // the rows' furthest key
      const csr_graph& blocks = mask.at(b, h).blocks;
      for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
        const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
        const std::int64_t j1 = std::min({j0 + g, mask.len_k(b), last_row + 1});
        for (std::int64_t c0 = j0; c0 < j1; c0 += kKeys) {
          const std::int64_t n = std::min(kKeys, j1 - c0), n16 = round_up(n, 16);
          load_transposed(kf, k0 + c0, n, h, dk, w.dk, w.kt.data());
          load_tile(vf, k0 + c0, n, h, dv, 1.0f, n16, w.dv, w.v.data());
          product_tiles(w.q.data(), w.dk, rows4, w.dk, w.kt.data(), n16, w.s.data());
          for (std::int64_t i = 0; i < rows4; ++i) {
            float* s = w.s.data() + i * kKeys;
            float* p = w.p.data() + i * kKeys;
            const std::int64_t keys = i < rows ? mask.last_key(b, i0 + i) + 1 - c0 : 0;
            const float top = mask_row(s, n16, std::min(keys, n));
            if (top == -kInf) {
              std::fill(p, p + n16, 0.0f);
              continue;
            }
            const float correction = softmax_step(s, n16, top, w.m[i], w.l[i], p);
            if (correction != 1.0f) {
              float* a = w.acc.data() + i * w.dv;
              for (std::int64_t d = 0; d < w.dv; ++d) a[d] *= correction;
            }
          }
          accumulate_tiles(w.p.data(), kKeys, rows4, n16, w.v.data(), w.dv, w.dv, w.acc.data(),
                           w.dv);
        }
      }
      for (std::int64_t i = 0; i < rows; ++i) {
        const float inv = w.l[i] > 0.0f ? 1.0f / w.l[i] : 0.0f;
        float* a = w.acc.data() + i * w.dv;
        for (std::int64_t d = 0; d < dv; ++d) a[d] *= inv;
        if (lse.data != nullptr) {
          const double row_lse = w.l[i] > 0.0f ? (double{w.m[i]} + std::log2(double{w.l[i]})) *
                                                     std::numbers::ln2_v<double>
                                               : -std::numeric_limits<double>::infinity();
          store_value(lse, q0 + i0 + i, h, 0, row_lse);
        }
      }
      store_tile(out, q0 + i0, rows, h, w.acc.data(), w.dv, 1.0f);
    }
  }
}

void block_sparse_backward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                   const tensor_view& k, const tensor_view& v,
                                   const tensor_view& out, const tensor_view& lse,
                                   const tensor_view& dout, const tensor_view& dq,
                                   const tensor_view& dk, const tensor_view& dv, double scale) {
  const operand<float> qf = as_operand<float>(q), kf = as_operand<float>(k),
                       vf = as_operand<float>(v), of = as_operand<float>(out),
                       df = as_operand<float>(dout);
  const std::int64_t heads = q.heads, dkd = q.dim, dvd = v.dim, g = mask.block;
  const float scale2 = static_cast<float>(scale) * std::numbers::log2e_v<float>;
  // Per row and head: lse in log2 units (+inf where the row saw no key: its P is 0) and
  // delta = rowsum(dO o O).
  const std::int64_t rows_q = q.rows;
  std::vector<float> lse2(static_cast<std::size_t>(rows_q * heads)),
      delta(static_cast<std::size_t>(rows_q * heads));
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows_q; ++i) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const double x = load_as_double(lse.data, lse.type, lse.offset(i, h, 0));
      lse2[i * heads + h] = std::isfinite(x) ? static_cast<float>(x * std::numbers::log2e) : kInf;
      const float* o = of.row(i, h);
      const float* d = df.row(i, h);
      float sum = 0.0f;
      for (std::int64_t c = 0; c < dvd; ++c) sum += o[c] * d[c];
      delta[i * heads + h] = sum;
    }
  }
  // One query tile's P and dS against a 64-key chunk whose K and V are in w.kt and w.vt (rows
  // of q and dO loaded, rows past `rows` zero): w.p = P, w.s = dS, both [rows4, kKeys].
  const auto probabilities = [&](tiles& w, std::int64_t b, std::int64_t h, std::int64_t i0,
                                 std::int64_t rows, std::int64_t c0, std::int64_t n) {
    const std::int64_t rows4 = round_up(rows, 4), n16 = round_up(n, 16);
    const std::int64_t q0 = mask.cu_seqlens_q[b];
    product_tiles(w.q.data(), w.dk, rows4, w.dk, w.kt.data(), n16, w.s.data());
    product_tiles(w.o.data(), w.dv, rows4, w.dv, w.vt.data(), n16, w.dp.data());
    for (std::int64_t i = 0; i < rows4; ++i) {
      float* s = w.s.data() + i * kKeys;
      float* p = w.p.data() + i * kKeys;
      const float* dp = w.dp.data() + i * kKeys;
      if (i >= rows) {
        std::fill(p, p + n16, 0.0f);
        std::fill(s, s + n16, 0.0f);
        continue;
      }
      const std::int64_t row = q0 + i0 + i;
      const std::int64_t keys = std::min(mask.last_key(b, i0 + i) + 1 - c0, n);
      mask_row(s, n16, keys);
      // +inf: the row saw no key (2^-inf: P = 0, dS = 0).
      gradient_row(s, dp, n16, lse2[row * heads + h], delta[row * heads + h], p);
    }
  };
  // Pass 1: dq per query block.
  const task_list row_tasks = units_of(mask, heads, false);
#pragma omp parallel
  {
    tiles w(dkd, dvd, g);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < row_tasks.size(); ++task) {
      const std::int64_t b = row_tasks.seq[task / heads], i0 = row_tasks.first[task / heads];
      const std::int64_t h = task % heads, r = i0 / g;
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const std::int64_t rows = std::min(g, mask.len_q(b) - i0), rows4 = round_up(rows, 4);
      load_tile(qf, q0 + i0, rows, h, dkd, scale2, rows4, w.dk, w.q.data());
      load_tile(df, q0 + i0, rows, h, dvd, 1.0f, rows4, w.dv, w.o.data());
      std::fill(w.acc.begin(), w.acc.begin() + rows4 * w.dk, 0.0f);
      const std::int64_t last_row = mask.last_key(b, i0 + rows - 1);
      const csr_graph& blocks = mask.at(b, h).blocks;
      for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
        const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
        const std::int64_t j1 = std::min({j0 + g, mask.len_k(b), last_row + 1});
        for (std::int64_t c0 = j0; c0 < j1; c0 += kKeys) {
          const std::int64_t n = std::min(kKeys, j1 - c0), n16 = round_up(n, 16);
          load_transposed(kf, k0 + c0, n, h, dkd, w.dk, w.kt.data());
          load_transposed(vf, k0 + c0, n, h, dvd, w.dv, w.vt.data());
          load_tile(kf, k0 + c0, n, h, dkd, 1.0f, n16, w.dk, w.k.data());
          probabilities(w, b, h, i0, rows, c0, n);
          accumulate_tiles(w.s.data(), kKeys, rows4, n16, w.k.data(), w.dk, w.dk, w.acc.data(),
                           w.dk);
        }
      }
      store_tile(dq, q0 + i0, rows, h, w.acc.data(), w.dk, static_cast<float>(scale));
    }
  }
  // Pass 2: dk and dv per 64 keys, over the query blocks that keep their block.
  std::vector<csr_graph> columns(mask.masks.size());
  for (std::size_t i = 0; i < mask.masks.size(); ++i) columns[i] = transpose(mask.masks[i].blocks);
  const task_list key_tasks = units_of(mask, heads, true);
#pragma omp parallel
  {
    tiles w(dkd, dvd, g);
    std::vector<float> pt(static_cast<std::size_t>(kKeys * w.rows));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < key_tasks.size(); ++task) {
      const std::int64_t b = key_tasks.seq[task / heads], c0 = key_tasks.first[task / heads];
      const std::int64_t h = task % heads, c = c0 / g;
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const std::int64_t n = std::min({kKeys, g - c0 % g, mask.len_k(b) - c0});
      const std::int64_t n2 = round_up(n, 2);
      load_transposed(kf, k0 + c0, n, h, dkd, w.dk, w.kt.data());
      load_transposed(vf, k0 + c0, n, h, dvd, w.dv, w.vt.data());
      std::fill(w.acc.begin(), w.acc.begin() + n2 * w.dv, 0.0f);    // dv
      std::fill(w.acc2.begin(), w.acc2.begin() + n2 * w.dk, 0.0f);  // dk
      const csr_graph& column =
          columns[static_cast<std::size_t>(b * mask.heads + (mask.heads == 1 ? 0 : h))];
      for (std::int64_t e = column.row_ptr[c]; e < column.row_ptr[c + 1]; ++e) {
        const std::int64_t i0 = std::int64_t{column.col_idx[e]} * g;
        const std::int64_t rows = std::min(g, mask.len_q(b) - i0), rows4 = round_up(rows, 4);
        if (mask.last_key(b, i0 + rows - 1) < c0) continue;  // causal: no row reaches these keys
        load_tile(qf, q0 + i0, rows, h, dkd, scale2, rows4, w.dk, w.q.data());
        load_tile(df, q0 + i0, rows, h, dvd, 1.0f, rows4, w.dv, w.o.data());
        probabilities(w, b, h, i0, rows, c0, n);
        // dv += P^T dO, dk += dS^T q (q unscaled: the scale and log2 e come off at the end).
        for (int which = 0; which < 2; ++which) {
          const float* src = which == 0 ? w.p.data() : w.s.data();
          for (std::int64_t j = 0; j < n2; ++j) {
            float* t = pt.data() + j * w.rows;
            for (std::int64_t i = 0; i < rows4; ++i) t[i] = j < n ? src[i * kKeys + j] : 0.0f;
          }
          if (which == 0) {
            accumulate_tiles(pt.data(), w.rows, n2, rows4, w.o.data(), w.dv, w.dv, w.acc.data(),
                             w.dv);
          } else {
            accumulate_tiles(pt.data(), w.rows, n2, rows4, w.q.data(), w.dk, w.dk, w.acc2.data(),
                             w.dk);
          }
        }
      }
      store_tile(dv, k0 + c0, n, h, w.acc.data(), w.dv, 1.0f);
      // w.q held q * scale * log2 e: dk = scale * dS^T q.
      store_tile(dk, k0 + c0, n, h, w.acc2.data(), w.dk, std::numbers::ln2_v<float>);
    }
  }
}

}  // namespace trisparse::cpu
