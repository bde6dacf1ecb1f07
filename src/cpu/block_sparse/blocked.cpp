// The CPU engine's block-sparse attention in tiles (fp32): a query block against
// 64-key chunks of its kept key blocks as small matrix products in registers (the AVX2 + FMA
// clones: 4 x 16 score tiles, 2 x 32 weighted-sum tiles), the online softmax between them. Each
// task transposes what stays for its whole walk once (the query block's q and dO for the forward
// and dq, the 64 keys' K and V for dk and dv); what changes along the walk is read in place, or
// packed next to each other where a weighted sum reads its rows many times. The backward recomputes
// P from the forward's lse in two passes with no shared writes: dq per query block over its kept
// blocks, dk and dv per 64-key chunk over the query blocks that keep its block (the transposed
// lists). Attention dropout's factors come a tile at a time, each Philox call's eight draws (a
// query set by a key pair) used together. Any block size and head dim.
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
#include "trisparse/core/dropout.hpp"

namespace trisparse::cpu {

namespace {

constexpr std::int64_t kKeys = 64;  // keys a chunk
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNoKey = -1e30f;  // a row's running max before its first key: finite, so that
                                  // the softmax's differences stay finite and its loops branchless

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

/// `count` rows read in place: row r at data + r * stride.
struct rows_ref {
  const float* data;
  std::int64_t stride, count;
};

/// C[r, 0:ncols) = sum over t < depth of A_r[t] * B[t, 0:ncols) for r < nrows (a multiple of 4;
/// rows past a.count repeat its last, their results unused), ncols a multiple of 16.
[[gnu::target_clones("arch=x86-64-v3", "default")]] void product_tiles(
    rows_ref a, std::int64_t nrows, std::int64_t depth, const float* b, std::int64_t ldb,
    std::int64_t ncols, float* c, std::int64_t ldc) {
  for (std::int64_t i0 = 0; i0 < nrows; i0 += 4) {
    const float* ar[4];
    for (int r = 0; r < 4; ++r) ar[r] = a.data + std::min(i0 + r, a.count - 1) * a.stride;
    for (std::int64_t j0 = 0; j0 < ncols; j0 += 16) {
      v8 acc[4][2] = {};
      for (std::int64_t t = 0; t < depth; ++t) {
        v8 b0, b1;
        std::memcpy(&b0, b + t * ldb + j0, sizeof b0);
        std::memcpy(&b1, b + t * ldb + j0 + 8, sizeof b1);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const float x = ar[r][t];
          acc[r][0] += x * b0;
          acc[r][1] += x * b1;
        }
      }
      for (int r = 0; r < 4; ++r) std::memcpy(c + (i0 + r) * ldc + j0, acc[r], sizeof acc[r]);
    }
  }
}

/// Two output rows' 8 V channels from d on: c0/c1 += sum over t of w0/w1[t * w_term] * B_t.
template <int V>
[[gnu::always_inline]] inline void accumulate_tile(const float* w0, const float* w1,
                                                   std::int64_t w_term, std::int64_t terms,
                                                   rows_ref b, std::int64_t d, float* c0,
                                                   float* c1) {
  v8 acc[2][V];
  std::memcpy(acc[0], c0 + d, sizeof acc[0]);
  std::memcpy(acc[1], c1 + d, sizeof acc[1]);
  for (std::int64_t t = 0; t < terms; ++t) {
    const float x0 = w0[t * w_term], x1 = w1[t * w_term];
    const float* row = b.data + t * b.stride + d;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      v8 x;
      std::memcpy(&x, row + 8 * v, sizeof x);
      acc[0][v] += x0 * x;
      acc[1][v] += x1 * x;
    }
  }
  std::memcpy(c0 + d, acc[0], sizeof acc[0]);
  std::memcpy(c1 + d, acc[1], sizeof acc[1]);
}

/// C[o, 0:cols) += sum over t < terms of W(o, t) * B_t[0:cols) for o < nout (a multiple of 2),
/// W(o, t) = w[o * w_out + t * w_term], B's rows read in place (8-channel vectors, then the
/// channels past the last whole vector one by one).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void accumulate_tiles(
    const float* w, std::int64_t w_out, std::int64_t w_term, std::int64_t nout, std::int64_t terms,
    rows_ref b, std::int64_t cols, float* c, std::int64_t ldc) {
  const std::int64_t whole = cols / 8 * 8;
  for (std::int64_t o = 0; o < nout; o += 2) {
    const float *w0 = w + o * w_out, *w1 = w0 + w_out;
    float *c0 = c + o * ldc, *c1 = c0 + ldc;
    std::int64_t d = 0;
    for (; d + 32 <= whole; d += 32) accumulate_tile<4>(w0, w1, w_term, terms, b, d, c0, c1);
    switch ((whole - d) / 8) {
      case 3:
        accumulate_tile<3>(w0, w1, w_term, terms, b, d, c0, c1);
        break;
      case 2:
        accumulate_tile<2>(w0, w1, w_term, terms, b, d, c0, c1);
        break;
      case 1:
        accumulate_tile<1>(w0, w1, w_term, terms, b, d, c0, c1);
        break;
      default:
        break;
    }
    for (d = whole; d < cols; ++d) {
      for (std::int64_t t = 0; t < terms; ++t) {
        c0[d] += w0[t * w_term] * b.data[t * b.stride + d];
        c1[d] += w1[t * w_term] * b.data[t * b.stride + d];
      }
    }
  }
}

/// The forward's online-softmax step over a chunk of n keys, vectorised over the query rows:
/// st[j * ld + i] holds key j's score for row i (scaled by scale * log2 e), keys from lim[i] on
/// excluded; p (same layout) gets 2^(s - m'), the running max m and sum l move on, and corr[i]
/// is the factor row i's accumulator takes. (Selections, not branches: the loops vectorise.)
[[gnu::target_clones("arch=x86-64-v3", "default")]] void softmax_step(
    const float* st, std::int64_t n, std::int64_t rows, std::int64_t ld, const float* lim, float* m,
    float* l, float* corr, float* top, float* p) {
#pragma omp simd
  for (std::int64_t i = 0; i < rows; ++i) top[i] = -kInf;
  for (std::int64_t j = 0; j < n; ++j) {
    const float* s = st + j * ld;
    const auto fj = static_cast<float>(j);
#pragma omp simd
    for (std::int64_t i = 0; i < rows; ++i) {
      const float x = fj < lim[i] ? s[i] : -kInf;
      top[i] = top[i] < x ? x : top[i];
    }
  }
#pragma omp simd
  for (std::int64_t i = 0; i < rows; ++i) {
    const float next = m[i] < top[i] ? top[i] : m[i];  // finite: m starts at kNoKey
    const float c = exp2_nonpositive(m[i] - next);
    corr[i] = c;
    m[i] = next;
    l[i] *= c;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    const float* s = st + j * ld;
    float* pj = p + j * ld;
    const auto fj = static_cast<float>(j);
#pragma omp simd
    for (std::int64_t i = 0; i < rows; ++i) {
      const float d = s[i] - m[i];  // (kept keys: <= 0; the rest, any value, weigh 0)
      const float x = exp2_nonpositive(d < 0.0f ? d : 0.0f) * static_cast<float>(fj < lim[i]);
      pj[i] = x;
      l[i] += x;
    }
  }
}

/// The dq pass's step, vectorised over the query rows (layouts as softmax_step's): in st,
/// dS = P (dP - delta) with P = 2^(s - lse2) (lse2 +inf where a row saw no key: P = 0).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void gradient_columns(
    float* st, const float* dpt, std::int64_t n, std::int64_t rows, std::int64_t ld,
    const float* lim, const float* lse2, const float* delta) {
  for (std::int64_t j = 0; j < n; ++j) {
    float* s = st + j * ld;
    const float* dp = dpt + j * ld;
    const auto fj = static_cast<float>(j);
#pragma omp simd
    for (std::int64_t i = 0; i < rows; ++i) {
      const float d = s[i] - lse2[i];
      const float x = exp2_nonpositive(d < 0.0f ? d : 0.0f) * static_cast<float>(fj < lim[i]);
      s[i] = x * (dp[i] - delta[i]);
    }
  }
}

/// The dk, dv pass's step for one query row over n keys (its first `keys` attended): the
/// unscaled scores s become dS, p gets P = 2^(scale2 * s - lse2).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void gradient_row(float* s, const float* dp,
                                                                      std::int64_t n,
                                                                      std::int64_t keys,
                                                                      float scale2, float lse2,
                                                                      float delta, float* p) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) {
    const float d = s[j] * scale2 - lse2;
    const float x = exp2_nonpositive(d < 0.0f ? d : 0.0f) * static_cast<float>(j < keys);
    p[j] = x;
    s[j] = x * (dp[j] - delta);
  }
}

/// to[d * ld + i] = factor * row (row0 + i) of `from` at channel d, for i < rows (zeros from
/// rows to ld) and d < dim.
void transpose_rows(const operand<float>& from, std::int64_t row0, std::int64_t rows,
                    std::int64_t h, std::int64_t dim, float factor, std::int64_t ld, float* to) {
  std::fill(to, to + dim * ld, 0.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* f = from.row(row0 + i, h);
    for (std::int64_t d = 0; d < dim; ++d) to[d * ld + i] = f[d] * factor;
  }
}

rows_ref rows_of(const operand<float>& o, std::int64_t row0, std::int64_t h, std::int64_t count) {
  return {o.row(row0, h), o.row_stride, count};
}

/// The rows copied next to each other into `to` (the operands' rows are H heads apart, so that
/// a chunk's rows fall into a few of L1's sets; the weighted sums read every row many times).
rows_ref packed(const operand<float>& o, std::int64_t row0, std::int64_t h, std::int64_t count,
                std::int64_t dim, std::vector<float>& to) {
  for (std::int64_t r = 0; r < count; ++r)
    std::memcpy(to.data() + r * dim, o.row(row0 + r, h), static_cast<std::size_t>(dim) * 4);
  return {to.data(), dim, count};
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

/// philox::draw for `count` key pairs at once, a loop the compiler vectorises: counter (set,
/// pair0 + t, head, offset) into x[0..3][t].
[[gnu::target_clones("arch=x86-64-v3", "default")]] void draw_pairs(
    std::uint32_t set, std::uint32_t pair0, std::uint32_t head, std::uint32_t offset,
    std::uint64_t seed, int count, std::uint32_t (*x)[kKeys]) {
#pragma omp simd
  for (int t = 0; t < count; ++t) {
    const philox::words w =
        philox::draw(set, pair0 + static_cast<std::uint32_t>(t), head, offset, seed);
    x[0][t] = w.x[0];
    x[1][t] = w.x[1];
    x[2][t] = w.x[2];
    x[3][t] = w.x[3];
  }
}

/// Attention dropout's factors for a tile of n <= 64 keys (philox::group's draws, as
/// dropout_factor gives them): f[i * rs + j * ks] = 0 or 1 / (1 - p) for a sequence's query rows
/// i0 + i (i < rows) and keys c0 + j (j < n) in draw head `head` (b * H + h). One Philox call per
/// query set ({a, a + 1, a + 8, a + 9}) and key pair the tile touches, its eight draws used
/// together.
void dropout_factors(const attention_dropout& d, std::int64_t head, std::int64_t i0,
                     std::int64_t rows, std::int64_t c0, std::int64_t n, std::int64_t rs,
                     std::int64_t ks, float* f) {
  const std::uint32_t below = philox::drop_below16(d.p);
  const auto keep = static_cast<float>(1.0 / (1.0 - d.p));
  const std::int64_t i1 = i0 + rows, pair0 = c0 / 2, pairs = (c0 + n + 1) / 2 - pair0;
  std::uint32_t x[4][kKeys];
  for (std::int64_t window = i0 / 16 * 16; window < i1; window += 16) {
    for (std::int64_t a = window; a < window + 8; a += 2) {
      const std::int64_t set[4] = {a, a + 1, a + 8, a + 9};
      if (std::none_of(set, set + 4, [&](std::int64_t i) { return i >= i0 && i < i1; })) continue;
      draw_pairs(static_cast<std::uint32_t>(philox::query_set(a)),
                 static_cast<std::uint32_t>(pair0), static_cast<std::uint32_t>(head),
                 static_cast<std::uint32_t>(d.state[1]), d.state[0], static_cast<int>(pairs), x);
      for (const std::int64_t i : set) {
        if (i < i0 || i >= i1) continue;
        const std::uint32_t* word = x[philox::pair_word(i)];
        float* row = f + (i - i0) * rs;
        if (c0 % 2 == 0 && n % 2 == 0) {  // whole pairs (every even block size)
          for (std::int64_t t = 0; t < n / 2; ++t) {
            row[2 * t * ks] = (word[t] & 0xFFFFu) < below ? 0.0f : keep;
            row[(2 * t + 1) * ks] = (word[t] >> 16) < below ? 0.0f : keep;
          }
          continue;
        }
        for (std::int64_t j = 0; j < n; ++j) {
          const std::int64_t key = c0 + j;
          const std::uint32_t draw = philox::pair_half(word[key / 2 - pair0], key);
          row[j * ks] = draw < below ? 0.0f : keep;
        }
      }
    }
  }
}

/// x[i * rs + j * ks] *= f[...] for i < rows, j < n (a tile by its dropout factors; the inner
/// loop along the unit stride, rs or ks = 1).
void scale_tile(float* x, const float* f, std::int64_t rows, std::int64_t n, std::int64_t rs,
                std::int64_t ks) {
  const bool by_rows = rs == 1;  // keys outer, rows inner
  const std::int64_t outer = by_rows ? n : rows, inner = by_rows ? rows : n;
  const std::int64_t step = by_rows ? ks : rs;
  for (std::int64_t o = 0; o < outer; ++o) {
    float* xo = x + o * step;
    const float* fo = f + o * step;
#pragma omp simd
    for (std::int64_t i = 0; i < inner; ++i) xo[i] *= fo[i];
  }
}

/// A thread's tiles, sized once for the mask's block: the transposed operands (qt, ot), the
/// score and weight tiles (s, p, dp; f: dropout's factors), the accumulators and the rows'
/// softmax state.
struct tiles {
  std::int64_t width;  // query rows a task, to a multiple of 16 (the transposed layouts' ld)
  std::vector<float> qt, ot, s, p, dp, f, acc, acc2, m, l, corr, top, lse2, delta, lim, rows_a,
      rows_b;
  tiles(std::int64_t dk, std::int64_t dv, std::int64_t block) : width(round_up(block, 16)) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    const std::int64_t side = std::max(width, kKeys), dmax = std::max(dk, dv);
    qt.resize(n(std::max(dk * side, dk * kKeys)));
    ot.resize(n(std::max(dv * side, dv * kKeys)));
    for (auto* t : {&s, &p, &dp, &f}) t->resize(n(side * side));
    for (auto* t : {&acc, &acc2, &rows_a, &rows_b}) t->resize(n(side * dmax));
    for (auto* t : {&m, &l, &corr, &top, &lse2, &delta, &lim}) t->resize(n(width));
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

/// A query task's place: sequence b, head h, the sequence's rows [i0, i0 + rows) (q0, k0: its
/// first query and key rows), the transposed tiles' width ld and the rows' furthest key.
struct query_task {
  std::int64_t b, h, i0, q0, k0, rows, ld, last;
  query_task(const block_sparse_mask& mask, const task_list& tasks, std::int64_t task)
      : b(tasks.seq[static_cast<std::size_t>(task / tasks.heads)]),
        h(task % tasks.heads),
        i0(tasks.first[static_cast<std::size_t>(task / tasks.heads)]),
        q0(mask.cu_seqlens_q[b]),
        k0(mask.cu_seqlens_k[b]),
        rows(std::min(mask.block, mask.len_q(b) - i0)),
        ld(round_up(rows, 16)),
        last(mask.last_key(b, i0 + rows - 1)) {}
};

/// Calls f(c0, n) for each chunk of up to 64 keys of the key blocks t's block row keeps, up to
/// the rows' furthest key, with w.lim holding how many of the chunk's keys each row attends.
template <class F>
void for_each_chunk(const block_sparse_mask& mask, const query_task& t, tiles& w, F&& f) {
  const std::int64_t g = mask.block, r = t.i0 / g;
  const csr_graph& blocks = mask.at(t.b, t.h).blocks;
  for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
    const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
    const std::int64_t j1 = std::min({j0 + g, mask.len_k(t.b), t.last + 1});
    for (std::int64_t c0 = j0; c0 < j1; c0 += kKeys) {
      const std::int64_t n = std::min(kKeys, j1 - c0);
      for (std::int64_t i = 0; i < w.width; ++i) {
        const std::int64_t keys = i < t.rows ? mask.last_key(t.b, t.i0 + i) + 1 - c0 : 0;
        w.lim[static_cast<std::size_t>(i)] =
            static_cast<float>(std::clamp<std::int64_t>(keys, 0, n));
      }
      f(c0, n);
    }
  }
}

}  // namespace

bool blocked_engine_takes(const tensor_view& q) { return q.type != dtype::f64; }

void block_sparse_forward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                  const tensor_view& k, const tensor_view& v,
                                  const tensor_view& out, double scale,
                                  const attention_dropout& dropout, const tensor_view& lse) {
  const bool drops = dropout.p > 0;
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
      const query_task t(mask, tasks, task);
      const std::int64_t rows2 = round_up(t.rows, 2);
      transpose_rows(qf, t.q0 + t.i0, t.rows, t.h, dk, scale2, t.ld, w.qt.data());
      std::fill(w.acc.begin(), w.acc.begin() + rows2 * dv, 0.0f);
      std::fill(w.m.begin(), w.m.end(), kNoKey);
      std::fill(w.l.begin(), w.l.end(), 0.0f);
      for_each_chunk(mask, t, w, [&](std::int64_t c0, std::int64_t n) {
        product_tiles(rows_of(kf, t.k0 + c0, t.h, n), round_up(n, 4), dk, w.qt.data(), t.ld, t.ld,
                      w.s.data(), t.ld);
        softmax_step(w.s.data(), n, t.ld, t.ld, w.lim.data(), w.m.data(), w.l.data(), w.corr.data(),
                     w.top.data(), w.p.data());
        if (drops) {  // the weights dropped, the normaliser l not
          dropout_factors(dropout, t.b * heads + t.h, t.i0, t.rows, c0, n, 1, t.ld, w.f.data());
          scale_tile(w.p.data(), w.f.data(), t.rows, n, 1, t.ld);
        }
        for (std::int64_t i = 0; i < t.rows; ++i) {
          const float c = w.corr[static_cast<std::size_t>(i)];
          if (c == 1.0f) continue;
          float* a = w.acc.data() + i * dv;
          for (std::int64_t d = 0; d < dv; ++d) a[d] *= c;
        }
        accumulate_tiles(w.p.data(), 1, t.ld, rows2, n, packed(vf, t.k0 + c0, t.h, n, dv, w.rows_a),
                         dv, w.acc.data(), dv);
      });
      for (std::int64_t i = 0; i < t.rows; ++i) {
        const float sum = w.l[static_cast<std::size_t>(i)], top = w.m[static_cast<std::size_t>(i)];
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        float* a = w.acc.data() + i * dv;
        for (std::int64_t d = 0; d < dv; ++d) a[d] *= inv;
        if (lse.data != nullptr) {
          const double row_lse =
              sum > 0.0f ? (double{top} + std::log2(double{sum})) * std::numbers::ln2_v<double>
                         : -std::numeric_limits<double>::infinity();
          store_value(lse, t.q0 + t.i0 + i, t.h, 0, row_lse);
        }
      }
      store_tile(out, t.q0 + t.i0, t.rows, t.h, w.acc.data(), dv, 1.0f);
    }
  }
}

void block_sparse_backward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                   const tensor_view& k, const tensor_view& v,
                                   const tensor_view& out, const tensor_view& lse,
                                   const tensor_view& dout, const tensor_view& dq,
                                   const tensor_view& dk, const tensor_view& dv, double scale,
                                   const attention_dropout& dropout) {
  const bool drops = dropout.p > 0;
  const operand<float> qf = as_operand<float>(q), kf = as_operand<float>(k),
                       vf = as_operand<float>(v), of = as_operand<float>(out),
                       df = as_operand<float>(dout);
  const std::int64_t heads = q.heads, dkd = q.dim, dvd = v.dim, g = mask.block;
  const float scale2 = static_cast<float>(scale) * std::numbers::log2e_v<float>;
  // Per row and head: lse in log2 units (+inf where the row saw no key: its P is 0) and
  // delta = rowsum(dO o O) (with dropout, O's kept weights: the sum of P m dP over the row).
  const std::int64_t rows_q = q.rows;
  std::vector<float> lse2(static_cast<std::size_t>(rows_q * heads)),
      delta(static_cast<std::size_t>(rows_q * heads));
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows_q; ++i) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const double x = load_as_double(lse.data, lse.type, lse.offset(i, h, 0));
      const auto at = static_cast<std::size_t>(i * heads + h);
      lse2[at] = std::isfinite(x) ? static_cast<float>(x * std::numbers::log2e) : kInf;
      const float *o = of.row(i, h), *d = df.row(i, h);
      float sum = 0.0f;
      for (std::int64_t c = 0; c < dvd; ++c) sum += o[c] * d[c];
      delta[at] = sum;
    }
  }
  // Pass 1: dq per query block, its q and dO transposed once; V read in place, K packed.
  const task_list row_tasks = units_of(mask, heads, false);
#pragma omp parallel
  {
    tiles w(dkd, dvd, g);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < row_tasks.size(); ++task) {
      const query_task t(mask, row_tasks, task);
      const std::int64_t rows2 = round_up(t.rows, 2);
      transpose_rows(qf, t.q0 + t.i0, t.rows, t.h, dkd, scale2, t.ld, w.qt.data());
      transpose_rows(df, t.q0 + t.i0, t.rows, t.h, dvd, 1.0f, t.ld, w.ot.data());
      for (std::int64_t i = 0; i < t.ld; ++i) {
        const auto at = static_cast<std::size_t>((t.q0 + t.i0 + i) * heads + t.h);
        w.lse2[static_cast<std::size_t>(i)] = i < t.rows ? lse2[at] : kInf;
        w.delta[static_cast<std::size_t>(i)] = i < t.rows ? delta[at] : 0.0f;
      }
      std::fill(w.acc.begin(), w.acc.begin() + rows2 * dkd, 0.0f);
      for_each_chunk(mask, t, w, [&](std::int64_t c0, std::int64_t n) {
        const std::int64_t n4 = round_up(n, 4);
        const rows_ref ks = packed(kf, t.k0 + c0, t.h, n, dkd, w.rows_a);
        product_tiles(ks, n4, dkd, w.qt.data(), t.ld, t.ld, w.s.data(), t.ld);
        product_tiles(rows_of(vf, t.k0 + c0, t.h, n), n4, dvd, w.ot.data(), t.ld, t.ld, w.dp.data(),
                      t.ld);
        if (drops) {  // dS = P (m dP - delta)
          dropout_factors(dropout, t.b * heads + t.h, t.i0, t.rows, c0, n, 1, t.ld, w.f.data());
          scale_tile(w.dp.data(), w.f.data(), t.rows, n, 1, t.ld);
        }
        gradient_columns(w.s.data(), w.dp.data(), n, t.ld, t.ld, w.lim.data(), w.lse2.data(),
                         w.delta.data());
        accumulate_tiles(w.s.data(), 1, t.ld, rows2, n, ks, dkd, w.acc.data(), dkd);
      });
      store_tile(dq, t.q0 + t.i0, t.rows, t.h, w.acc.data(), dkd, static_cast<float>(scale));
    }
  }
  // Pass 2: dk and dv per 64 keys, their K and V transposed once, the q and dO rows of the query
  // blocks that keep their block (the transposed lists) packed.
  std::vector<csr_graph> columns(mask.masks.size());
  for (std::size_t i = 0; i < mask.masks.size(); ++i) columns[i] = transpose(mask.masks[i].blocks);
  const task_list key_tasks = units_of(mask, heads, true);
#pragma omp parallel
  {
    tiles w(dkd, dvd, g);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < key_tasks.size(); ++task) {
      const std::int64_t b = key_tasks.seq[task / heads], c0 = key_tasks.first[task / heads];
      const std::int64_t h = task % heads, c = c0 / g;
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const std::int64_t n = std::min({kKeys, (c + 1) * g - c0, mask.len_k(b) - c0});
      const std::int64_t n16 = round_up(n, 16), n2 = round_up(n, 2);
      transpose_rows(kf, k0 + c0, n, h, dkd, 1.0f, kKeys, w.qt.data());
      transpose_rows(vf, k0 + c0, n, h, dvd, 1.0f, kKeys, w.ot.data());
      std::fill(w.acc.begin(), w.acc.begin() + n2 * dvd, 0.0f);    // dv
      std::fill(w.acc2.begin(), w.acc2.begin() + n2 * dkd, 0.0f);  // dk
      const csr_graph& column =
          columns[static_cast<std::size_t>(b * mask.heads + (mask.heads == 1 ? 0 : h))];
      for (std::int64_t e = column.row_ptr[c]; e < column.row_ptr[c + 1]; ++e) {
        const std::int64_t i0 = std::int64_t{column.col_idx[e]} * g;
        const std::int64_t rows = std::min(g, mask.len_q(b) - i0), rows4 = round_up(rows, 4);
        if (mask.last_key(b, i0 + rows - 1) < c0) continue;  // causal: no row reaches these keys
        const rows_ref qs = packed(qf, q0 + i0, h, rows, dkd, w.rows_a),
                       dos = packed(df, q0 + i0, h, rows, dvd, w.rows_b);
        product_tiles(qs, rows4, dkd, w.qt.data(), kKeys, n16, w.s.data(), kKeys);
        product_tiles(dos, rows4, dvd, w.ot.data(), kKeys, n16, w.dp.data(), kKeys);
        if (drops) {  // dS = P (m dP - delta) below; dv's weights P m after
          dropout_factors(dropout, b * heads + h, i0, rows, c0, n, kKeys, 1, w.f.data());
          scale_tile(w.dp.data(), w.f.data(), rows, n, kKeys, 1);
        }
        for (std::int64_t i = 0; i < rows; ++i) {
          const auto at = static_cast<std::size_t>((q0 + i0 + i) * heads + h);
          const std::int64_t keys =
              std::clamp<std::int64_t>(mask.last_key(b, i0 + i) + 1 - c0, 0, n);
          gradient_row(w.s.data() + i * kKeys, w.dp.data() + i * kKeys, n16, keys, scale2, lse2[at],
                       delta[at], w.p.data() + i * kKeys);
        }
        if (drops) scale_tile(w.p.data(), w.f.data(), rows, n, kKeys, 1);
        // dv += P^T dO, dk += dS^T q (scaled at the end).
        accumulate_tiles(w.p.data(), 1, kKeys, n2, rows, dos, dvd, w.acc.data(), dvd);
        accumulate_tiles(w.s.data(), 1, kKeys, n2, rows, qs, dkd, w.acc2.data(), dkd);
      }
      store_tile(dv, k0 + c0, n, h, w.acc.data(), dvd, 1.0f);
      store_tile(dk, k0 + c0, n, h, w.acc2.data(), dkd, static_cast<float>(scale));
    }
  }
}

}  // namespace trisparse::cpu
