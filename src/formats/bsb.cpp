#include "trisparse/formats/bsb.hpp"

#include <algorithm>
#include <bit>
#include <numeric>
#include <string>

#include "trisparse/core/error.hpp"

namespace trisparse {

namespace {
[[noreturn]] void broken(const std::string& why) {
  throw invalid_input("bsb invariant broken: " + why);
}

// Sorted distinct columns of rows [r0, r1).
void window_columns(const csr_graph& g, std::int64_t r0, std::int64_t r1,
                    std::vector<std::int32_t>& out) {
  out.assign(g.col_idx.begin() + g.row_ptr[r0], g.col_idx.begin() + g.row_ptr[r1]);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}
}  // namespace

std::int64_t bsb::bytes() const {
  return static_cast<std::int64_t>(8 * tcb_offset.size() + 4 * col_idx.size() + 8 * bitmap.size() +
                                   4 * window_order.size());
}

bsb_view bsb::view() const {
  return {rows,
          cols,
          windows(),
          tcbs(),
          tcb_cols,
          words_per_tcb(),
          tcb_offset.data(),
          col_idx.data(),
          bitmap.data(),
          window_order.data()};
}

std::int64_t count_tcbs(const csr_graph& g, int tcb_cols) {
  TRISPARSE_EXPECTS_INPUT(tcb_cols == 8 || tcb_cols == 16,
                          "BSB tcb_cols must be 8 or 16, got " + std::to_string(tcb_cols));
  constexpr int kR = bsb::kRowWindow;
  const std::int64_t windows = (g.rows + kR - 1) / kR;
  std::int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    std::vector<std::int32_t> cols;
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t w = 0; w < windows; ++w) {
      window_columns(g, w * kR, std::min(g.rows, (w + 1) * kR), cols);
      total += (static_cast<std::int64_t>(cols.size()) + tcb_cols - 1) / tcb_cols;
    }
  }
  return total;
}

bsb build_bsb(const csr_graph& g, int tcb_cols) {
  g.check();
  TRISPARSE_EXPECTS_INPUT(tcb_cols == 8 || tcb_cols == 16,
                          "BSB tcb_cols must be 8 or 16, got " + std::to_string(tcb_cols));
  constexpr int kR = bsb::kRowWindow;
  bsb f;
  f.rows = g.rows;
  f.cols = g.cols;
  f.tcb_cols = tcb_cols;
  const std::int64_t windows = (g.rows + kR - 1) / kR;
  const int words = f.words_per_tcb();
  std::vector<std::int64_t> count(windows + 1, 0);
#pragma omp parallel
  {
    std::vector<std::int32_t> cols;
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t w = 0; w < windows; ++w) {
      window_columns(g, w * kR, std::min(g.rows, (w + 1) * kR), cols);
      count[w + 1] = (static_cast<std::int64_t>(cols.size()) + tcb_cols - 1) / tcb_cols;
    }
  }
  std::partial_sum(count.begin(), count.end(), count.begin());
  f.tcb_offset = count;
  const std::int64_t tcbs = f.tcbs();
  f.col_idx.assign(tcbs * tcb_cols, bsb::kPadColumn);
  f.bitmap.assign(tcbs * words, 0);
#pragma omp parallel
  {
    std::vector<std::int32_t> cols;
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t w = 0; w < windows; ++w) {
      const std::int64_t r0 = w * kR, r1 = std::min(g.rows, (w + 1) * kR);
      window_columns(g, r0, r1, cols);
      const std::int64_t slot0 = f.tcb_offset[w] * tcb_cols;
      std::copy(cols.begin(), cols.end(), f.col_idx.begin() + slot0);
      for (std::int64_t r = r0; r < r1; ++r) {
        // Rows and the window's columns are both sorted: walk them together.
        auto it = cols.begin();
        for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
          it = std::lower_bound(it, cols.end(), g.col_idx[e]);
          const std::int64_t slot = it - cols.begin();
          const std::int64_t tcb = f.tcb_offset[w] + slot / tcb_cols;
          const int bit = static_cast<int>((r - r0) * tcb_cols + slot % tcb_cols);
          f.bitmap[tcb * words + bit / 64] |= std::uint64_t{1} << (bit % 64);
        }
      }
    }
  }
  f.window_order.resize(windows);
  std::iota(f.window_order.begin(), f.window_order.end(), 0);
  std::stable_sort(
      f.window_order.begin(), f.window_order.end(),
      [&](std::int32_t a, std::int32_t b) { return f.window_tcbs(a) > f.window_tcbs(b); });
  return f;
}

void bsb::check() const {
  constexpr int kR = kRowWindow;
  if (tcb_cols != 8 && tcb_cols != 16) broken("tcb_cols is " + std::to_string(tcb_cols));
  if (rows < 0 || cols < 0) broken("negative shape");
  const std::int64_t w_expect = (rows + kR - 1) / kR;
  if (windows() != w_expect)
    broken("has " + std::to_string(windows()) + " windows, expected " + std::to_string(w_expect));
  if (tcb_offset.front() != 0) broken("tcb_offset[0] != 0");
  if (static_cast<std::int64_t>(col_idx.size()) != tcbs() * tcb_cols)
    broken("col_idx size != tcbs * tcb_cols");
  if (static_cast<std::int64_t>(bitmap.size()) != tcbs() * words_per_tcb())
    broken("bitmap size != tcbs * words");
  if (static_cast<std::int64_t>(window_order.size()) != windows())
    broken("window_order size != windows");
  std::vector<char> seen(windows(), 0);
  for (std::int64_t i = 0; i < windows(); ++i) {
    const std::int32_t w = window_order[i];
    if (w < 0 || w >= windows() || seen[w]) broken("window_order is not a permutation");
    seen[w] = 1;
    if (i > 0 && window_tcbs(w) > window_tcbs(window_order[i - 1]))
      broken("window_order not by decreasing TCB count");
  }
  for (std::int64_t w = 0; w < windows(); ++w) {
    if (tcb_offset[w + 1] < tcb_offset[w])
      broken("tcb_offset decreases at window " + std::to_string(w));
    const std::int64_t valid_rows = std::min<std::int64_t>(kR, rows - w * kR);
    const std::int64_t s0 = tcb_offset[w] * tcb_cols, s1 = tcb_offset[w + 1] * tcb_cols;
    bool padding = false;
    for (std::int64_t s = s0; s < s1; ++s) {
      const std::int64_t tcb = s / tcb_cols;
      const int c = static_cast<int>(s % tcb_cols);
      bool any = false;
      for (int r = 0; r < kR; ++r) {
        if (!test(tcb, r, c)) continue;
        if (r >= valid_rows)
          broken("bit set on row past the matrix in window " + std::to_string(w));
        any = true;
      }
      if (col_idx[s] == kPadColumn) {
        if (any) broken("bit set on a padding slot in window " + std::to_string(w));
        padding = true;
        continue;
      }
      if (padding) broken("padding before a column in window " + std::to_string(w));
      if (col_idx[s] < 0 || col_idx[s] >= cols)
        broken("column " + std::to_string(col_idx[s]) + " out of range");
      if (s > s0 && col_idx[s] <= col_idx[s - 1])
        broken("columns not increasing in window " + std::to_string(w));
      if (!any) broken("empty compacted column in window " + std::to_string(w));
    }
    if (s1 > s0 && col_idx[s1 - tcb_cols] == kPadColumn)
      broken("an all-padding TCB in window " + std::to_string(w));
  }
}

csr_graph to_csr(const bsb& f) {
  constexpr int kR = bsb::kRowWindow;
  csr_graph g;
  g.rows = f.rows;
  g.cols = f.cols;
  g.row_ptr.assign(f.rows + 1, 0);
  for (std::int64_t w = 0; w < f.windows(); ++w) {
    for (std::int64_t t = f.tcb_offset[w]; t < f.tcb_offset[w + 1]; ++t) {
      for (int r = 0; r < kR && w * kR + r < f.rows; ++r) {
        for (int c = 0; c < f.tcb_cols; ++c) g.row_ptr[w * kR + r + 1] += f.test(t, r, c);
      }
    }
  }
  std::partial_sum(g.row_ptr.begin(), g.row_ptr.end(), g.row_ptr.begin());
  g.col_idx.resize(g.row_ptr.back());
  std::vector<std::int64_t> at(g.row_ptr.begin(), g.row_ptr.end() - 1);
  for (std::int64_t w = 0; w < f.windows(); ++w) {
    for (std::int64_t t = f.tcb_offset[w]; t < f.tcb_offset[w + 1]; ++t) {
      for (int r = 0; r < kR && w * kR + r < f.rows; ++r) {
        for (int c = 0; c < f.tcb_cols; ++c) {
          if (f.test(t, r, c)) g.col_idx[at[w * kR + r]++] = f.col_idx[t * f.tcb_cols + c];
        }
      }
    }
  }
  return g;
}

}  // namespace trisparse
