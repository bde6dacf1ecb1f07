#pragma once
/// @file The sparse kernels GNN layers are made of -- SpMM, SDDMM and a row softmax -- over one
/// pattern, through a plan built once per pattern and device (on CUDA: FlashSparse's ME-BCRS
/// with 8x1 vectors and swap-and-transpose tensor-core MMA; on the CPU: the float64 reference).
///
/// Per-edge values (SDDMM output, softmax in and out, SpMM's weights) live in the plan's *slot
/// layout*, so that the three operations chain without reordering: a tensor_view of
/// [slots(), heads, 1] with slot stride 1 (one contiguous array per head). On the CPU the slot
/// layout is the CSR entry order. to_slots() and to_entries() convert from and to CSR entry order
/// ([nnz, heads, 1], any strides).
#include <cstdint>
#include <memory>
#include <string>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/graph/reorder.hpp"

namespace trisparse {

/// How CUDA kernels multiply f32 operands on the tensor cores. tf32 rounds each operand to a
/// 10-bit mantissa (FlashSparse's TF32 mode): a dot product is off by about 1e-3 of |x| |y|, which
/// a softmax of large scores turns into large factors (a score of 1e4 off by 5 weighs e^5 wrong).
/// tf32x3 adds the products with each operand's rounding remainder (three MMAs instead of one):
/// about float32 accuracy.
enum class f32_math { tf32, tf32x3 };

struct sparse_plan_options {
  /// CUDA: rows per nonzero vector: 8 (FlashSparse's 8x1 vectors) or 16 (the 16x1 ablation).
  int vector_rows = 8;
  /// CUDA: row windows with more 8-vector blocks than this are split across warps
  /// (0 = chosen from the block total and the device's SM count).
  std::int32_t split_blocks = 0;
  /// CUDA SpMM: work items of at least this many blocks are shared by the 4 warps of one thread
  /// block, which add their partial tiles in shared memory (0 = chosen from the block total and
  /// the SM count, at least 8; negative = never, one warp per item).
  std::int32_t team_blocks = 0;
  /// CUDA plans from a host pattern: how rows are grouped into windows (results always come back
  /// in the pattern's row order). A window's distinct columns are its vectors, and each vector
  /// costs a gathered row of B (SpMM) or Y (SDDMM), so orders that put rows sharing columns
  /// together save work. automatic: the clustered order (seeded in RCM order on square patterns)
  /// where it cuts the vector count by at least 10% (patterns up to 4M nonzeros), else original.
  /// rcm needs a square pattern.
  row_order order = row_order::automatic;
  /// CUDA SDDMM with f32 x and y (SpMM's f32 products are always tf32: its weights are not
  /// amplified afterwards).
  f32_math sddmm_f32 = f32_math::tf32;
  /// CUDA: the largest heads and feature width (SpMM's n) that the plan's own workspace, sized
  /// at build, serves; runs beyond it pass their own (workspace_bytes()).
  std::int64_t workspace_heads = 8, workspace_dim = 256;
};

struct sparse_plan_report {
  device_kind where = device_kind::cpu;
  std::int64_t rows = 0, cols = 0, nnz = 0;
  std::int64_t windows = 0, vectors = 0, slots = 0;  ///< CPU: windows = vectors = 0, slots = nnz
  std::int64_t format_bytes = 0;                     ///< CUDA: ME-BCRS arrays; CPU: the CSR
  std::int64_t sr_bcrs_bytes = 0;  ///< CUDA: the same pattern padded to whole blocks (SR-BCRS)
  double build_seconds = 0;
  std::string format;                     ///< "csr" or "me-bcrs8x1" / "me-bcrs16x1"
  row_order order = row_order::original;  ///< CUDA: the row order the plan uses
};

/// One sparse pattern A (rows x cols, with values or binary = all 1) prepared on one device.
/// Cheap to copy (shared, immutable state). CUDA runs are asynchronous on `stream` and never
/// synchronise the host, allocate or lock. Runs given their own workspace (workspace_bytes())
/// may overlap on different streams; runs on the plan's own workspace must not.
class sparse_plan {
 public:
  /// @throws invalid_input if the pattern is broken; not_supported without the CUDA backend.
  static sparse_plan build(const csr_graph& pattern, device_kind where = device_kind::cpu,
                           const sparse_plan_options& options = {}, stream_ref stream = {});
  /// A CUDA plan from a pattern in device memory (values: device [nnz] floats or nullptr for
  /// all 1). Columns may be unsorted or repeated within a row (repeats share one slot and their
  /// values add up; without values the slot holds 1). @throws invalid_input naming the broken
  /// invariant.
  static sparse_plan build(const csr_view& pattern, const float* values = nullptr,
                           const sparse_plan_options& options = {}, stream_ref stream = {});

  /// Bytes of workspace that an SpMM, SDDMM or softmax run with `heads` heads of width `dim`
  /// needs on this plan's device (0 on the CPU; SDDMM needs none).
  std::size_t workspace_bytes(std::int64_t heads, std::int64_t dim) const;

  /// Length of a per-edge value array in the slot layout.
  std::int64_t slots() const;
  const sparse_plan_report& report() const;

  /// c = A_h b_h for every head h. values: [slots, H, 1] per-head weights, or a view with
  /// data == nullptr for the pattern's own values (shared by all heads). b: [cols, H, n],
  /// c: [rows, H, n]. CUDA: b f16, bf16 or f32 (computed in tf32), values in b's dtype, c f32 or
  /// b's dtype; any n (n % 16 == 0 and 16-byte aligned rows run fastest).
  /// `workspace`: at least workspace_bytes(b.heads, b.dim) bytes, or empty for the plan's own.
  void spmm(const tensor_view& values, const tensor_view& b, const tensor_view& c,
            stream_ref stream = {}, workspace_view workspace = {}) const;
  /// out = scale * A ⊙ (x y^T) in the slot layout: out[e] = a_e * scale * <x[row(e)], y[col(e)]>,
  /// 0 in slots without an entry. x: [rows, H, d], y: [cols, H, d] (one dtype: f16, bf16 or f32,
  /// computed on CUDA as sparse_plan_options.sddmm_f32 says), out: [slots, H, 1] f32 or x's dtype.
  void sddmm(const tensor_view& x, const tensor_view& y, const tensor_view& out, double scale = 1.0,
             stream_ref stream = {}) const;
  /// Max-stabilised row softmax over each row's entries (fp32 inside); slots without an entry
  /// get 0. scores, out: [slots, H, 1], f32, f16 or bf16; may be the same array.
  /// `workspace`: at least workspace_bytes(scores.heads, 1) bytes, or empty for the plan's own.
  void softmax(const tensor_view& scores, const tensor_view& out, stream_ref stream = {},
               workspace_view workspace = {}) const;

  /// entries: [nnz, H, 1] in CSR entry order -> slots: [slots, H, 1] (same dtype; other slots 0).
  void to_slots(const tensor_view& entries, const tensor_view& slots, stream_ref stream = {}) const;
  /// slots -> entries in CSR entry order.
  void to_entries(const tensor_view& slots, const tensor_view& entries,
                  stream_ref stream = {}) const;

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

}  // namespace trisparse
