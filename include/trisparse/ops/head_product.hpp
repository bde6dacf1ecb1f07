#pragma once
/// @file Products with a small weight per head, and their weight's gradient: TransformerConv's
/// edge weight W_e applied per head (its score term W_eᵀ q_i and its message term W_e Σ α a, each
/// [N, H, a] times [H, a, b]), for float32 on the CPU and CUDA. As one GEMM with a block-diagonal
/// weight, H - 1 of every H products would multiply zeros; batched per head (cuBLAS), the [N, 16]
/// operands run far below the bandwidth. Here a pass reads each row once. On CUDA stream-ordered,
/// no allocation, no host synchronisation; the CPU computes in float64 and rounds once (the
/// reference the CUDA kernels are tested against).
#include <cstddef>
#include <cstdint>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse {

/// The widest a and b the CUDA kernels take (register arrays of this many floats a thread).
inline constexpr std::int64_t kHeadProductMaxWidth = 32;

/// out[n, h, :] = x[n, h, :] · w[h] for x [N, H, a], w [H, a, b] (a view of rows H, heads a, dim
/// b) and out [N, H, b]: float32, one device, any strides with a unit last one, out overlapping
/// neither input. Each output element is summed over a in order.
/// @throws invalid_input for other shapes, dtypes or devices; not_supported on CUDA for a or b
/// above kHeadProductMaxWidth.
void head_product(const tensor_view& x, const tensor_view& w, const tensor_view& out,
                  stream_ref stream = {});

/// Bytes of the workspace head_outer takes on CUDA (one partial [H, a, b] per chunk of
/// kHeadOuterChunkRows rows); 0 on the CPU.
std::size_t head_outer_workspace_bytes(std::int64_t rows, std::int64_t heads, std::int64_t a,
                                       std::int64_t b);

/// The rows a partial sum of head_outer covers on CUDA.
inline constexpr std::int64_t kHeadOuterChunkRows = 512;

/// dw[h] = Σ_n x[n, h, :]ᵀ g[n, h, :] for x [N, H, a], g [N, H, b] and dw [H, a, b] (rows H,
/// heads a, dim b): head_product's weight gradient. float32 on one device, unit last strides. On
/// CUDA each chunk of kHeadOuterChunkRows rows is summed in row order and the chunks in chunk
/// order (no atomics: the same bits on every run), `workspace` holding head_outer_workspace_bytes.
/// @throws invalid_input as head_product does, or for a short workspace.
void head_outer(const tensor_view& x, const tensor_view& g, const tensor_view& dw,
                void* workspace = nullptr, std::size_t workspace_bytes = 0, stream_ref stream = {});

}  // namespace trisparse
