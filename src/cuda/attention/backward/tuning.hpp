#pragma once
// The CUDA attention backward's shapes (constexpr; measured on H100 and H200:
// docs/notes/attention_backward.md).

#include <cstdint>

namespace trisparse::cuda::attention_backward {

constexpr int kWarps = 4;         // warps per thread block, one (chunk, head) each
constexpr int kMaxHeadDim = 256;  // the CUDA-core kernels: 8 floats a lane of a 32-lane head
constexpr int kUnroll = 4;        // entries a warp loads and reduces together (latency hiding)
// Entries per work chunk: rows (of the pattern or its transpose) with more are cut into chunks of
// this many whose fp32 partial sums a second kernel adds in chunk order, so a hub row is spread
// over many warps and the sums stay deterministic. Larger chunks cost less workspace (one
// partial row per chunk of a cut row), smaller ones balance better.
constexpr int kChunkEntries = 256;
// TCBs per work chunk of the tensor-core kernels (16 rows x 8 columns each): larger windows are
// cut into chunks, their partial rows (16 per chunk of a cut window, each heads x dim floats)
// added in chunk order by the last chunk of the window to finish. A chunk holds at least
// kChunkTcbs, and at least the pattern's TCBs over chunks_per_sm x the SMs, so that on a large
// pattern only windows far above the even share of the work are cut: the partial rows stay few
// (rmat20, 8 heads x 64: 11.3 GB of them at 32 TCBs a chunk, 1.7 GB at 32 chunks an SM). Runs of
// kCoarseFromHeads heads or more take the coarse chunks (their heads give the parallelism); fewer
// heads, the fine ones (balance: rmat20 at one head ran 1.23 x slower on 32 chunks an SM than on
// 32-TCB chunks). Small patterns keep 32-TCB chunks at both sizes.
constexpr int kChunkTcbs = 32;
constexpr int kFineChunksPerSm = 128;
constexpr int kCoarseChunksPerSm = 32;
constexpr int kCoarseFromHeads = 4;
// A plan from a host pattern runs each tensor-core pass over windows in reverse Cuthill-McKee
// order where that leaves at most this percentage of the pass's TCBs (the forward keeps 65 %, its
// densest windows lengthening; the backward cuts long windows into chunks, and its time follows
// the TCB count).
constexpr std::int64_t kRcmKeepPercent = 90;
// The fine chunks run largest first (one head: the tail sets the time); the coarse ones largest
// first too where true, else the cut windows' chunks first and the rest in window order.
constexpr bool kCoarseLargestFirst = false;

}  // namespace trisparse::cuda::attention_backward
