#pragma once
// The walk of the block-sparse kernels (block_sparse/tile.cuh's interface) for attention within
// segments: the thread block's stationary rows are BM consecutive packed rows (queries, or keys in
// the dk/dv kernel: the pattern is symmetric), its streamed tiles of BN rows run from its first
// row's segment start to its last row's segment end (ids sorted: the bounds grow with the row), and
// a pair is hidden when the streamed row lies outside the stationary row's segment.
#include <climits>

#include "../block_sparse/tile.cuh"

namespace trisparse::cuda::segments {

/// The pairs' score bias: none, a dense one per pair (params::pair_bias: [rows, H, M]), or one per
/// edge (params::query_ptr ...: trisparse::segment_edges).
enum class pair_bias { none, dense, edges };

/// KEYS: the stationary rows are keys (the dk/dv kernel). BIAS: the pairs' score bias added to the
/// scores; the dq kernel writes its gradient.
template <int BM, int BN, bool KEYS, pair_bias BIAS = pair_bias::none>
struct segment_walk {
  static constexpr bool kPairBias = BIAS == pair_bias::dense;
  static constexpr bool kEdgeBias = BIAS == pair_bias::edges;
  const block_sparse::params& p;
  int h, lq, lk, row0, seq = 0;  // one sequence of packed rows
  std::int64_t q0 = 0, k0 = 0;
  int j, j_end;      // streamed tiles from j, BN rows apart, while j < j_end
  int lo[2], hi[2];  // the segments of the thread's stationary rows r_lo and r_lo + 8
  // kEdgeBias: each stationary row's cursor into its edge list (by query, or by key with KEYS), the
  // list's end, the streamed row of the cursor's edge (INT_MAX past the end) and the cursor at the
  // start of the tile last biased (for its gradients). Tiles come with rising streamed rows, so a
  // cursor only moves forward: an edge is read once a thread and tile.
  mutable int cur[2], end[2], at[2], tile_cur[2];

  __device__ __forceinline__ explicit segment_walk(const block_sparse::params& params) : p(params) {
    h = static_cast<int>(blockIdx.x / p.num_tiles);
    row0 = static_cast<int>(blockIdx.x % p.num_tiles) * BM;
    lq = lk = p.segment_rows;
    arch::wait_for_primary();  // the bounds come from the kernel before
    const int last = min(row0 + BM, lq) - 1;
    const std::int32_t* bounds = p.segments;  // two a row: 64-bit offsets past 2^30 rows
    // From an even row, or with dropout a multiple of 16, so that a thread's streamed rows share
    // their dropout draws (tile.cuh: dropout_draws); the rows before the segment are hidden as
    // any other.
    j = bounds[2 * std::int64_t{row0}] & (p.dropout_state != nullptr ? ~15 : ~1);
    j_end = bounds[2 * std::int64_t{last} + 1];
    const int r_lo =
        row0 + static_cast<int>(threadIdx.x) / 32 * 16 + static_cast<int>(threadIdx.x) % 32 / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = r_lo + 8 * r;
      lo[r] = i < lq ? bounds[2 * std::int64_t{i}] : 0;
      hi[r] = i < lq ? bounds[2 * std::int64_t{i} + 1] : 0;
      if constexpr (kEdgeBias) {
        const std::int32_t* ptr = KEYS ? p.key_ptr : p.query_ptr;
        cur[r] = i < lq ? ptr[i] : 0;
        end[r] = i < lq ? ptr[i + 1] : 0;
        at[r] = streamed_at(cur[r], r);
      }
    }
  }

  /// The streamed row of edge list entry c of stationary slot r (INT_MAX past its end).
  __device__ __forceinline__ int streamed_at(int c, int r) const {
    return c < end[r] ? (KEYS ? p.key_query : p.query_key)[c] : INT_MAX;
  }

  /// The first row of the next streamed tile, or -1 past the end.
  __device__ __forceinline__ int next() {
    if (j >= j_end) return -1;
    const int at = j;
    j += BN;
    return at;
  }
  /// Every tile may mix segments.
  __device__ __forceinline__ bool masks(int) const { return true; }
  __device__ __forceinline__ float bias2(int) const { return 0.f; }  // (no block bias)
  /// The bias of query i and key j (not hidden: one segment, starting at lo[r]), log2 units.
  __device__ __forceinline__ float pair_bias2(int i, int j_key, int r) const {
    return p.pair_bias[std::int64_t{i} * p.pair_row + h * p.pair_head + (j_key - lo[r])] *
           1.4426950408889634f;
  }
  /// dL/dS of query i and key j (not hidden) into dpair_bias, where set (the dq kernel).
  __device__ __forceinline__ void store_dpair(int i, int j_key, int r, float ds) const {
    if (p.dpair_bias != nullptr)
      p.dpair_bias[std::int64_t{i} * p.dpair_row + h * p.dpair_head + (j_key - lo[r])] = ds;
  }

  /// kEdgeBias: adds to the tile's scores s (m16n8 accumulator layout, streamed rows j0 .. j0 + BN
  /// - 1) the biases (log2 units) of the edges of the thread's stationary rows that fall in its own
  /// columns; hidden pairs (NaN) stay hidden. Called once a tile, tiles rising.
  __device__ __forceinline__ void add_edge_bias(float (&s)[BN / 8][4], int j0) const {
    for_tile_edges(j0, true, [&]<int R>(int n, bool odd, int edge) {
      const float b =
          p.pair_bias[std::int64_t{edge} * p.pair_row + h * p.pair_head] * 1.4426950408889634f;
#pragma unroll
      for (int k = 0; k < BN / 8; ++k) {  // (selects: the fragments stay in registers)
        s[k][2 * R] += k == n && !odd ? b : 0.f;
        s[k][2 * R + 1] += k == n && odd ? b : 0.f;
      }
    });
  }
  /// kEdgeBias: each edge of the tile add_edge_bias biased last takes its pair's dS from t (the dq
  /// kernel, where dpair_bias is set).
  __device__ __forceinline__ void store_edge_grads(const float (&t)[BN / 8][4], int j0) const {
    if (p.dpair_bias == nullptr) return;
    for_tile_edges(j0, false, [&]<int R>(int n, bool odd, int edge) {
      float ds = 0.f;
#pragma unroll
      for (int k = 0; k < BN / 8; ++k)
        if (k == n) ds = odd ? t[k][2 * R + 1] : t[k][2 * R];
      p.dpair_bias[std::int64_t{edge} * p.dpair_row + h * p.dpair_head] = ds;
    });
  }

 private:
  /// f.template operator()<r>(n, odd, edge) for each edge of the thread's stationary row slot r
  /// whose streamed row lies in the tile j0 .. j0 + BN - 1 and in the thread's columns (fragment n,
  /// element 2 r + odd); `advance`: moves the cursors past the tile (remembering where it began),
  /// else walks again from there.
  template <class F>
  __device__ __forceinline__ void for_tile_edges(int j0, bool advance, F&& f) const {
    const int tq = static_cast<int>(threadIdx.x) % 4;
    const auto slot = [&]<int R>() {
      int c = advance ? cur[R] : tile_cur[R];
      int row = advance ? at[R] : streamed_at(c, R);
      while (row < j0) row = streamed_at(++c, R);  // (rows before the tile: other segments)
      if (advance) tile_cur[R] = c;
      for (; row < j0 + BN; row = streamed_at(++c, R)) {
        const int col = row - j0;
        if (((col >> 1) & 3) == tq) f.template operator()<R>(col >> 3, (col & 1) != 0, edge_of(c));
      }
      if (advance) {
        cur[R] = c;
        at[R] = row;
      }
    };
    slot.template operator()<0>();
    slot.template operator()<1>();
  }
  /// The edge of list entry c.
  __device__ __forceinline__ int edge_of(int c) const {
    return (KEYS ? p.key_edge : p.query_edge)[c];
  }

 public:
  /// Query i and key j lie in different segments (r: the stationary row's slot).
  __device__ __forceinline__ bool hides(int i, int j_key, int r) const {
    const int other = KEYS ? i : j_key;
    return other < lo[r] || other >= hi[r];
  }
};

}  // namespace trisparse::cuda::segments
