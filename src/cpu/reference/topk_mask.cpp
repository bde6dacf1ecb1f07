// The top-k block mask on the CPU: the definition the GPU selection is tested against.
#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "../../formats/block_sparse_internal.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/block_sparse.hpp"

namespace trisparse {

using detail::empty_block_mask;

block_sparse_mask topk_block_mask(const tensor_view& q, const tensor_view& k,
                                  std::span<const std::int64_t> cu_seqlens_q,
                                  std::span<const std::int64_t> cu_seqlens_k,
                                  const topk_mask_options& o) {
  TRISPARSE_EXPECTS_INPUT(o.block >= 1 && o.top_k >= 0,
                          "top-k block mask: block must be >= 1 and top_k >= 0");
  block_sparse_mask mask;
  mask.block = o.block;
  mask.heads = q.heads;
  mask.causal = o.causal;
  mask.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  mask.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  TRISPARSE_EXPECTS_INPUT(
      !mask.cu_seqlens_q.empty() && mask.cu_seqlens_q.size() == mask.cu_seqlens_k.size(),
      "top-k block mask: cu_seqlens_q and cu_seqlens_k need the same number "
      "(>= 1) of offsets");
  check_view(q, "q", mask.cu_seqlens_q.back(), -1, -1);
  check_view(k, "k", mask.cu_seqlens_k.back(), q.heads, q.dim);
  TRISPARSE_EXPECTS_INPUT(q.where == device_kind::cpu && k.where == device_kind::cpu,
                          "top-k block mask: q and k must be on the CPU");
  const std::int64_t g = o.block, heads = q.heads, d = q.dim;
  // Block means of one sequence and head: [blocks, d].
  const auto pooled = [&](const tensor_view& t, std::int64_t row0, std::int64_t len,
                          std::int64_t h) {
    const std::int64_t nb = (len + g - 1) / g;
    std::vector<double> m(static_cast<std::size_t>(nb * d), 0.0);
    for (std::int64_t i = 0; i < len; ++i) {
      for (std::int64_t c = 0; c < d; ++c)
        m[(i / g) * d + c] += load_as_double(t.data, t.type, t.offset(row0 + i, h, c));
    }
    for (std::int64_t blk = 0; blk < nb; ++blk) {
      const auto rows = static_cast<double>(std::min(g, len - blk * g));
      for (std::int64_t c = 0; c < d; ++c) m[blk * d + c] /= rows;
    }
    return m;
  };
  for (std::int64_t b = 0; b + 1 < static_cast<std::int64_t>(mask.cu_seqlens_q.size()); ++b) {
    const std::int64_t lq = mask.cu_seqlens_q[b + 1] - mask.cu_seqlens_q[b];
    const std::int64_t lk = mask.cu_seqlens_k[b + 1] - mask.cu_seqlens_k[b];
    TRISPARSE_EXPECTS_INPUT(
        lq >= 0 && lk >= 0,
        "top-k block mask: cu_seqlens decrease at sequence " + std::to_string(b));
    const std::int64_t nbq = (lq + g - 1) / g;
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::vector<double> qm = pooled(q, mask.cu_seqlens_q[b], lq, h),
                                km = pooled(k, mask.cu_seqlens_k[b], lk, h);
      block_mask m = empty_block_mask(lq, lk, g);
      m.blocks.row_ptr.assign(nbq + 1, 0);
      std::vector<std::pair<double, std::int32_t>> scored;
      for (std::int64_t r = 0; r < nbq; ++r) {
        // The key aligned with the block's last row (bottom right); with causal, the key blocks
        // up to it are those with a key some row of the block may see.
        const std::int64_t row = std::min(lq, (r + 1) * g) - 1, aligned = row + (lk - lq);
        const std::int64_t last = mask.last_key(b, row);
        const std::int64_t allowed = last < 0 ? 0 : last / g + 1;
        scored.clear();
        for (std::int64_t c = 0; c < allowed; ++c) {
          double s = 0;
          for (std::int64_t x = 0; x < d; ++x) s += qm[r * d + x] * km[c * d + x];
          scored.emplace_back(-s, static_cast<std::int32_t>(c));  // ascending = best first
        }
        const auto keep = static_cast<std::size_t>(std::min<std::int64_t>(o.top_k, allowed));
        std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(keep),
                          scored.end());
        std::vector<std::int32_t> cols;
        for (std::size_t i = 0; i < keep; ++i) cols.push_back(scored[i].second);
        if (o.keep_diagonal && aligned >= 0 && lk > 0)  // the block holding the aligned key
          cols.push_back(static_cast<std::int32_t>(std::min(aligned, lk - 1) / g));
        std::sort(cols.begin(), cols.end());
        cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
        m.blocks.col_idx.insert(m.blocks.col_idx.end(), cols.begin(), cols.end());
        m.blocks.row_ptr[r + 1] = static_cast<std::int64_t>(m.blocks.col_idx.size());
      }
      mask.masks.push_back(std::move(m));
    }
  }
  mask.check();
  return mask;
}

}  // namespace trisparse
