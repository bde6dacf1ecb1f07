#pragma once
// The CUDA attention backward's shapes (constexpr; measured on H100:
// docs/notes/attention_backward.md).

namespace trisparse::cuda::attention_backward {

constexpr int kWarps = 4;      // warps per thread block, one (chunk, head) each
constexpr int kMaxChunks = 8;  // head dims up to 8 x 32 = 256: elements lane, lane + 32, ...
constexpr int kUnroll = 4;     // entries a warp loads and reduces together (latency hiding)
// Entries per work chunk: rows (of the pattern or its transpose) with more are cut into chunks of
// this many whose fp32 partial sums a second kernel adds in chunk order, so a hub row is spread
// over many warps and the sums stay deterministic. Larger chunks cost less workspace (one
// partial row per chunk of a cut row), smaller ones balance better.
constexpr int kChunkEntries = 256;
// TCBs per work chunk of the tensor-core kernels (16 rows x 8 columns each): larger windows are
// cut into chunks of this many, their partial rows added in chunk order as above.
constexpr int kChunkTcbs = 32;

}  // namespace trisparse::cuda::attention_backward
