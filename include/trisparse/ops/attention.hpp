#pragma once
/// @file Sparse attention O = softmax(scale * (Q K^T ⊙ A)) V through a plan built once per pattern
/// and device. The pattern A is binary (values are ignored); rows without entries give zeros.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trisparse/core/dropout.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/graph/reorder.hpp"

namespace trisparse {

/// How the attention is computed. Which device computes it is the plan's (device_kind); the
/// pair names one backend (backend_name). The float64 oracle every backend is tested against is
/// not among them: it is its own entry point, trisparse::reference (ops/reference.hpp).
enum class algorithm : std::uint8_t {
  automatic,          ///< the fastest for the plan's device and pattern
  blocked_reference,  ///< float64 blocked online softmax over the BSB format (CPU)
  fused,    ///< one pass with an online softmax: the OpenMP engine (CPU), the fused 3S kernel over
            ///< BSB on tensor cores (CUDA; block masks: their element patterns)
  unfused,  ///< SDDMM -> softmax -> SpMM kernels (CUDA)
  block,    ///< the block kernel over block masks, G a multiple of 16 (CUDA)
};
std::string_view to_string(algorithm a);
/// @throws invalid_input naming the algorithms there are.
algorithm parse_algorithm(std::string_view name);
/// Whether `a` runs on `where` (automatic runs everywhere): the one rule of which device runs
/// what.
bool runs_on(algorithm a, device_kind where);
/// The backend that runs `a` on `where` over a graph pattern: "cpu_blocked_reference",
/// "cpu_fused", "cuda_fused3s", "cuda_me_bcrs"; over a block mask (`block_mask`): "cpu_block"
/// (fused), "cuda_block", "cuda_block_unfused", "cuda_fused3s" (the mask's element pattern).
/// docs/design.md maps each to its folder, namespace, notes and benchmark.
std::string backend_name(algorithm a, device_kind where, bool block_mask = false);

/// The order in which the CUDA graph kernels (the fused 3S forward, the backward's tensor-core
/// passes) take their (row window, head) tasks; the results are the same bits in either.
enum class head_order : std::uint8_t {
  automatic,  ///< by_head where a model of the L2 cache says it keeps >= 20 % of the row loads
              ///< out of DRAM (scattered gathers whose rows, all heads', outgrow the L2), else
              ///< by_window; plans from device patterns: by_window
  by_window,  ///< a window's heads side by side (each row's heads read together)
  by_head,    ///< every window of one head before the next head's (one head's rows in flight)
};
std::string_view to_string(head_order o);
/// "automatic" (or "auto"), "by_window", "by_head". @throws invalid_input otherwise.
head_order parse_head_order(std::string_view name);

struct plan_options {
  algorithm algo = algorithm::automatic;  ///< what the plan prepares formats for
  int tcb_cols = 8;                       ///< BSB tensor-core block width (8 or 16)
  /// fused on CUDA: row windows with more TCBs are split across warps and merged
  /// (0 = chosen from the windows' TCB counts and the device by a model of the kernel's schedule).
  std::int32_t split_tcbs = 0;
  /// fused on CUDA: work items of at least this many TCBs are shared by the 4 warps of one
  /// thread block, which combine their softmax states in shared memory (0 = how many of the
  /// largest items is chosen per heads and head dim by the same model; negative = never, one warp
  /// per item).
  std::int32_t team_tcbs = 0;
  /// CUDA plans from a host pattern: how query rows are grouped into windows (and, with
  /// gradients, the backward's tensor-core windows of queries and of keys). automatic: fused on
  /// CUDA uses reverse Cuthill-McKee where it cuts the TCB count by >= 35% (square patterns up to
  /// 4M nonzeros; the backward where it cuts a pass's TCBs by >= 10%, for the pattern and its
  /// transpose each), else the original order; unfused as sparse_plan does.
  row_order order = row_order::automatic;
  /// CUDA, fused 3S and the backward's tensor-core passes: the order of their (window, head) tasks.
  head_order heads = head_order::automatic;
  /// CUDA: the largest heads and head dim that the plan's own workspace, sized at build, serves
  /// (the workspace of runs not given one); larger runs pass their own (workspace_bytes()).
  std::int64_t workspace_heads = 8, workspace_dim = 256;
  /// Prepare backward(): the transposed pattern, whose rows give dk and dv without atomics.
  bool gradients = false;
};

struct attention_options {
  std::optional<double> scale;            ///< default 1/sqrt(head_dim)
  algorithm algo = algorithm::automatic;  ///< automatic = the plan's algorithm
  /// run(): where data != nullptr, also the per-row log-sum-exp of the scaled scores, what
  /// backward() needs: [rows, H, 1] (f32 for the fused algorithms), natural log, -inf for empty
  /// rows. The reference and fused algorithms (CPU and CUDA); block-sparse plans with
  /// algorithm::block on CUDA (f32) and the CPU engine (f32, or f64 for exact float64 gradients).
  tensor_view lse{};
  /// A per-entry additive score bias: S_ij = scale q_i . k_j + bias[e, h] for entry e = (i, j) in
  /// the pattern's CSR order (rows sorted, columns sorted within a row). [nnz, H, 1], or
  /// [nnz, 1, 1] for one bias shared by the heads; f32 on CUDA, any float dtype on the CPU; finite
  /// (drop an entry from the pattern instead of giving it -inf). data == nullptr: none. A bias of
  /// log(m_e) counts entry e as m_e copies, each a separate term of the softmax (a repeated edge,
  /// as PyG counts it); learned biases (GATConv's edge term, Graphormer's encodings) take their
  /// gradient from backward()'s dbias. run() and backward() of the reference and fused algorithms;
  /// on CUDA a biased run takes the row-wise kernels (a plan with plan_options::gradients).
  tensor_view bias{};
  /// backward(): where data != nullptr, dL/dbias = dL/dS per entry and head, [nnz, H, 1] in CSR
  /// entry order (f32 on CUDA; any float dtype on the CPU), overwritten; each entry is written
  /// once, so it is deterministic (sum over the heads for a shared bias). With or without a bias.
  tensor_view dbias{};
  /// Block-sparse backward() only (CUDA algorithm::block, the CPU): where data != nullptr, each
  /// kept block's attention mass per head, the softmax weights P (recomputed from the forward's
  /// lse) summed over the block's (query, key) pairs and divided by the block's query rows, so
  /// that a block row's masses sum to 1 when the mask keeps every key: f32 (f64 too on the CPU)
  /// [batch * QB, H, KB], row b * QB + r for sequence b's query block r, QB and KB the longest
  /// sequence's query and key blocks. Blocks the mask drops are not written (fill them first).
  /// Each block is written once, in a fixed order of sums: deterministic. What a learned pattern
  /// keeps (block_pattern.hpp).
  tensor_view block_mass{};
  /// As block_mass, the sum of |dS| over the block, dS = dL/dz for the scaled score z (not
  /// divided by the rows): how much the loss moves with the block's scores.
  tensor_view block_grad{};
  /// Block-sparse plans only (run() and backward() of the CPU engine and of CUDA
  /// algorithm::block): a per-block additive score bias, S_ij = scale q_i . k_j + B[row, h, c] for
  /// every pair of the kept block (query block r, key block c) of sequence b, row = b * QB + r
  /// (block_mass's layout): [batch * QB, H, KB], or [batch * QB, 1, KB] shared by the heads; f32
  /// (f64 too on the CPU), finite. Blocks the mask drops are not read. Relative-position or
  /// learned block biases (Graphormer-style encodings at block granularity), or a gate's log-score
  /// that makes a block selection differentiable. data == nullptr: none.
  tensor_view block_bias{};
  /// backward(): where data != nullptr, dL/dB = the sum of dS = dL/dS over each kept block's pairs,
  /// [batch * QB, H, KB] (f32, f64 too on the CPU), overwritten at the kept blocks (fill the rest
  /// first); a fixed order of sums, no atomics: the same bits on every run. For a bias shared by
  /// the heads, sum it over the heads.
  tensor_view dblock_bias{};
  /// Attention dropout drawn in the kernels (trisparse/core/dropout.hpp): run() and backward() of
  /// segment_attention_plan, of CUDA block-sparse (algorithm::block; every kernel: mma.sync and
  /// sm_90's wgmma) and top-k plans, and of CPU block-sparse plans (the CPU engine, the same
  /// draws; the state in host memory there); the other plans throw not_supported for p > 0.
  attention_dropout dropout{};
};

/// The head dims the CUDA tensor-core attention kernels of this build take (the fused 3S
/// kernel's; CMake's TRISPARSE_HEAD_DIMS), ascending; without the CUDA backend, CMake's default
/// (32, 64, 128, 256).
std::vector<std::int64_t> cuda_head_dims();

/// The scale run() applies: options.scale, or 1/sqrt(head_dim). @throws invalid_input if not
/// finite.
double effective_scale(const attention_options& options, std::int64_t head_dim);

/// What build() chose and what it cost.
struct plan_report {
  algorithm algo = algorithm::automatic;
  device_kind where = device_kind::cpu;
  std::int64_t rows = 0, cols = 0, nnz = 0;
  double build_seconds = 0;
  std::int64_t format_bytes = 0;
  std::string format;  ///< "csr", "csr+bsb16x8", ...
};

/// Holds the formats for one pattern on one device; run() only computes.
/// Cheap to copy (shared, immutable state).
class attention_plan {
 public:
  /// Builds the formats the algorithm needs. @throws invalid_input if the pattern is broken;
  /// not_supported if the device or algorithm is not in this build.
  static attention_plan build(const csr_graph& pattern, device_kind where = device_kind::cpu,
                              const plan_options& options = {}, stream_ref stream = {});
  /// Builds a plan on the view's device from a pattern the caller holds there. On CUDA the view is
  /// validated and the format built on the device, with no host copy of the pattern (the
  /// report's build_seconds is then the whole device build). Columns may be unsorted or repeated
  /// within a row, except with plan_options::gradients: then each row's columns must strictly
  /// increase, and the transposed pattern is built on the device too.
  /// @throws invalid_input naming the broken invariant.
  static attention_plan build(const csr_view& pattern, const plan_options& options = {},
                              stream_ref stream = {});

  /// out = attention(q, k, v). q: [rows, H, D], k: [cols, H, D], v: [cols, H, Dv],
  /// out: [rows, H, Dv]; all on the plan's device. CPU runs synchronously; CUDA is asynchronous
  /// on `stream` and never synchronises the host, allocates or locks. On CUDA the fused
  /// algorithm runs f16/bf16 on tensor cores and f32 row-wise in f32 (a warp per chunk of at most
  /// 256 entries of a row and group of heads), which needs a plan built with
  /// plan_options::gradients (it holds the device CSR).
  /// `workspace`: device memory of at least workspace_bytes(q.heads, max(q.dim, v.dim)) bytes,
  /// 256-byte aligned, used on `stream` only, so runs with different workspaces may overlap on
  /// different streams and a run can be captured in a CUDA graph. Empty (the default): the plan's
  /// own, sized at build (plan_options::workspace_heads / workspace_dim); such runs must not
  /// overlap.
  /// @throws invalid_input naming the argument whose shape, dtype or device is wrong, or a
  /// workspace too small for heads x head_dim.
  void run(const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
           const attention_options& options = {}, stream_ref stream = {},
           workspace_view workspace = {}) const;
  /// Bytes of workspace that a run with `heads` heads of `head_dim` needs (0 on the CPU).
  std::size_t workspace_bytes(std::int64_t heads, std::int64_t head_dim) const;

  /// Gradients of out = run(q, k, v) given dout = dL/dout: dq [rows, H, D], dk [cols, H, D],
  /// dv [cols, H, Dv], overwritten (rows and columns without entries get exact zeros). `out` and
  /// `lse` are what run() wrote for these q, k, v (lse through attention_options::lse). Bitwise
  /// deterministic: no atomics, the same result on every run and thread count. Needs
  /// plan_options::gradients (the transposed pattern), except the CPU reference. CPU: fused (from
  /// out and lse) and reference (float64, ignores out and lse). CUDA (a plan built from a host
  /// pattern): a row pass and a pass over the transposed pattern, one warp per chunk of at most
  /// 256 entries and group of heads (longer rows' partial sums added in a fixed order), q/k/v f16,
  /// bf16 or f32 with head dims up to 256, fp32 accumulation; lse (f32) may be empty and is then
  /// recomputed. Asynchronous on `stream`; `workspace`: backward_workspace_bytes() bytes, or empty
  /// for the plan's own (plan_options::workspace_heads/workspace_dim).
  /// @throws invalid_input naming a wrong argument.
  void backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
                const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                const attention_options& options = {}, stream_ref stream = {},
                workspace_view workspace = {}) const;

  /// Bytes of workspace that a CUDA backward of q's dtype `type` with `heads` heads of up to
  /// `head_dim` elements (q's and v's) needs (0 on the CPU): per-row terms, partial sums of rows
  /// and columns cut into chunks for balance (hubs), and for f16/bf16 the tensor-core kernels' P
  /// and dS (4 bytes an entry and head). The default, f16, covers every dtype.
  std::size_t backward_workspace_bytes(std::int64_t heads, std::int64_t head_dim,
                                       dtype type = dtype::f16) const;
  const plan_report& report() const;
  /// The algorithm that run() uses for `requested` (automatic -> the plan's own).
  algorithm resolve(algorithm requested) const;

 private:
  struct state;
  static void own_unfused_workspace(state& s, const plan_options& options);
  // The backward's own workspace, for the device plan already in `s`.
  static void own_backward(state& s, const plan_options& options);
  // The plan's own workspace of the backward and the f32 forward, checked against q's and v's.
  workspace_view own_grad_workspace(const tensor_view& q, const tensor_view& v) const;
  std::shared_ptr<const state> state_;
};

/// True when this build has the CUDA backend and a device is visible.
bool cuda_available();

}  // namespace trisparse
