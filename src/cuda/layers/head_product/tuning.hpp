#pragma once
// The per-head products' launch shapes (constexpr).

namespace trisparse::cuda::head_product_tuning {

constexpr int kProductWarps = 8;    // heads a thread block of the product (a warp each, 32 rows)
constexpr int kOuterThreads = 256;  // a thread block of the weight gradient's chunk pass
constexpr int kOuterTile = 16;      // rows of x and g staged in shared memory at a time
constexpr int kSumWarps = 8;        // a thread block of the chunks' sum (32 outputs)

}  // namespace trisparse::cuda::head_product_tuning
