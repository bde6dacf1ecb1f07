#pragma once
// Host interface of the CUDA fused block-sparse attention backend (no CUDA headers: ops/
// includes it).
#include <cstdint>
#include <memory>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/ops/block_sparse.hpp"

namespace trisparse::cuda {

/// A block mask on the device and its query tiles in launch order.
struct block_sparse_device_plan;

/// Whether the fused kernel takes masks at this block size (a multiple of 16).
bool block_sparse_supports(std::int64_t block);

/// Uploads a checked mask (block a multiple of 16), chooses the kernel (`kernel`: automatic
/// resolved for the current device) and orders its query tiles by work, most first. Synchronous
/// on `stream`. @throws not_supported without the CUDA backend, for a block size the kernel has no
/// tile for, or for wgmma where it cannot run.
std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan(const block_sparse_mask& mask,
                                                                 block_kernel kernel,
                                                                 stream_ref stream);

/// The kernel the plan runs ("mma.sync" or "wgmma").
const char* kernel_name(const block_sparse_device_plan& plan);

/// out = attention(q, k, v) under the plan's mask, asynchronous on `stream`. q, k, v all f16 or
/// all bf16, head_dim 64 or 128 (v's dim = q's), out f32, f16 or bf16; 16-byte aligned data and
/// strides that are multiples of 8 elements. Shapes are checked by the caller.
/// @throws invalid_input for unsupported dtypes, dims or layouts.
void run_block_sparse(const block_sparse_device_plan& plan, const tensor_view& q,
                      const tensor_view& k, const tensor_view& v, const tensor_view& out,
                      double scale, stream_ref stream);

std::int64_t device_bytes(const block_sparse_device_plan& plan);

}  // namespace trisparse::cuda
