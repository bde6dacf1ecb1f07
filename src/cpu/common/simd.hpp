// Eight floats as one vector (GCC and Clang's vector extension): AVX registers in the functions
// cloned for AVX2, two SSE registers in the default clones. Moved in and out with memcpy
// (unaligned), and never passed by value across a call (the AVX ABI would differ between clones).
#pragma once

#include <cstdint>
#include <cstring>

namespace trisparse::cpu {

using v8 = float __attribute__((vector_size(32)));

/// out[0, 8 V) = sum over t in [0, n) of weight(t) * row(t)[0, 8 V), in V vector accumulators
/// that stay in registers (inlined into each caller, so into each of its clones). With
/// `kSkipZero`, terms of weight 0 are skipped (they add exactly 0 for finite rows).
template <int V, bool kSkipZero, class Weight, class Row>
[[gnu::always_inline]] inline void weighted_rows(std::int64_t n, const Weight& weight,
                                                 const Row& row, float* out) {
  v8 s[V] = {};
  for (std::int64_t t = 0; t < n; ++t) {
    const float x = weight(t);
    if (kSkipZero && x == 0.0f) continue;
    const float* r = row(t);
#pragma GCC unroll 4
    for (int i = 0; i < V; ++i) {
      v8 b;
      std::memcpy(&b, r + 8 * i, sizeof b);
      s[i] += x * b;
    }
  }
  std::memcpy(out, s, sizeof s);
}

}  // namespace trisparse::cpu
