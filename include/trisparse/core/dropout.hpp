#pragma once
/// @file Attention dropout drawn inside the fused kernels: a counter-based generator
/// (Philox4x32-10, Salmon et al., SC'11) keyed by a seed and counted by (query rows, key row
/// pair, head, offset) or (input edge, heads, offset), so the backward regenerates the forward's
/// draws instead of storing them, and any backend (the float64 references, the tests) can compute
/// the same draws. Host and device (nvcc) code; no CUDA headers.
#include <cstdint>

#include "trisparse/core/host_device.hpp"

namespace trisparse {

/// Attention dropout (attention_options::dropout): each softmax weight P_ij of head h is kept
/// with probability 1 - p and then scaled by 1 / (1 - p), or set to 0; the normaliser (the
/// log-sum-exp) is the undropped one, as torch's and PyG's dropout of the attention weights.
/// `state` points to two uint64 {seed, offset} where the plan runs (device memory for CUDA plans,
/// host memory for the CPU), read by the kernels at each call (so a generator state written on
/// the device, or captured in a CUDA graph, serves): give the same state to backward() as to
/// run(). p = 0: no dropout (p > 0 needs a state).
struct attention_dropout {
  double p = 0;
  const std::uint64_t* state = nullptr;
};

namespace philox {

/// Philox4x32 with 10 rounds: four 32-bit counters and a 64-bit key to four random words.
struct words {
  std::uint32_t x[4];
};

TRISPARSE_HOST_DEVICE std::uint32_t mul_hi(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<std::uint32_t>((std::uint64_t{a} * b) >> 32);
#endif
}

TRISPARSE_HOST_DEVICE words draw(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                 std::uint32_t c3, std::uint64_t key) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const std::uint32_t hi0 = mul_hi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const std::uint32_t hi1 = mul_hi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

/// The four-query set of query row i in group(): {a, a + 1, a + 8, a + 9}, a = 16 (i / 16) +
/// 2 ((i % 8) / 2).
TRISPARSE_HOST_DEVICE std::int64_t query_set(std::int64_t i) {
  return ((i >> 4) << 2) | ((i >> 1) & 3);
}

/// The draws of the (query, key) group holding query row i and key row j of head h (the offset's
/// low 32 bits count the fourth word): eight 16-bit draws from one call, for the four queries of
/// query_set(i) by the two keys {j & ~1, j | 1}. Pair (i, j)'s draw is half j & 1 (low, high) of
/// word pair_word(i). The shape fits the kernels' m16n8 fragments both ways round: two lanes
/// (rows r and r ^ 1) hold a group in each pair of key columns with the queries as rows and, with
/// the keys as rows, in each pair of query columns 8 apart (tiles and streamed rows start at
/// multiples of 16). Rows are the sequence's own (attention within segments: the packed rows, one
/// sequence), h = sequence * heads + head.
TRISPARSE_HOST_DEVICE words group(std::int64_t i, std::int64_t j, std::int32_t h,
                                  std::uint64_t seed, std::uint64_t offset) {
  return draw(static_cast<std::uint32_t>(query_set(i)), static_cast<std::uint32_t>(j >> 1),
              static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(offset), seed);
}

/// The word of group() holding query row i's two draws.
TRISPARSE_HOST_DEVICE int pair_word(std::int64_t i) {
  return static_cast<int>(((i >> 3) & 1) * 2 + (i & 1));
}

/// Key row j's draw in a word of group(): its low (even j) or high half.
TRISPARSE_HOST_DEVICE std::uint32_t pair_half(std::uint32_t word, std::int64_t j) {
  return (j & 1) != 0 ? word >> 16 : word & 0xFFFFu;
}

/// The words of input edge u for heads 4 t .. 4 t + 3 (t = h / 4): the edge-keyed draws of the
/// multigraph and GAT kernels, Philox counted by (u's low and high 32 bits, t, offset); head h's
/// draw is word h % 4 (edge_word), so one call serves four heads.
TRISPARSE_HOST_DEVICE words edge_group(std::int64_t u, std::int32_t h, std::uint64_t seed,
                                       std::uint64_t offset) {
  return draw(static_cast<std::uint32_t>(u), static_cast<std::uint32_t>(u >> 32),
              static_cast<std::uint32_t>(h >> 2), static_cast<std::uint32_t>(offset), seed);
}

/// Input edge u's word in head h.
TRISPARSE_HOST_DEVICE std::uint32_t edge_word(std::int64_t u, std::int32_t h, std::uint64_t seed,
                                              std::uint64_t offset) {
  const words w = edge_group(u, h, seed, offset);
  const int k = h & 3;
  return k == 0 ? w.x[0] : k == 1 ? w.x[1] : k == 2 ? w.x[2] : w.x[3];
}

/// A 32-bit word below this is a drop (the edge draws): round(p 2^32), p in [0, 1).
TRISPARSE_HOST_DEVICE std::uint32_t drop_below(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 4294967295u : static_cast<std::uint32_t>(t + 0.5);
}

/// A 16-bit draw below this is a drop (the pair draws): round(p 2^16), p in [0, 1).
TRISPARSE_HOST_DEVICE std::uint32_t drop_below16(double p) {
  const double t = p * 65536.0;
  return t >= 65535.0 ? 65535u : static_cast<std::uint32_t>(t + 0.5);
}

}  // namespace philox

/// The factor attention dropout puts on pair (i, j) of head h: 0 (dropped) or 1 / (1 - p).
inline double dropout_factor(const attention_dropout& d, std::uint64_t seed, std::uint64_t offset,
                             std::int64_t i, std::int64_t j, std::int32_t h) {
  if (d.p <= 0) return 1.0;
  const philox::words w = philox::group(i, j, h, seed, offset);
  const std::uint32_t x = philox::pair_half(w.x[philox::pair_word(i)], j);
  return x < philox::drop_below16(d.p) ? 0.0 : 1.0 / (1.0 - d.p);
}

/// The factor attention dropout puts on input edge u in head h (the edge-keyed draws).
inline double edge_dropout_factor(const attention_dropout& d, std::uint64_t seed,
                                  std::uint64_t offset, std::int64_t u, std::int32_t h) {
  if (d.p <= 0) return 1.0;
  return philox::edge_word(u, h, seed, offset) < philox::drop_below(d.p) ? 0.0 : 1.0 / (1.0 - d.p);
}

}  // namespace trisparse
