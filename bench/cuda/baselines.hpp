#pragma once
// Baselines the fused 3S benchmark times in the same run (bench only, not the library):
//   * cusparse_pipeline: cusparseSDDMM -> a stable row softmax of ours -> cusparseSpMM, per head,
//     in fp32 (Q, K, V converted once, outside the timing) or fp16 (S in fp16 where cuSPARSE
//     allows it, else fp32; P in fp16; O in fp32);
//   * dense_masked: cuBLAS S = Q K^T (fp32), a masked row softmax over a dense bit mask writing P
//     in fp16, cuBLAS O = P V (fp32), per head, where rows x cols fits the given budget.
// Each object holds its descriptors and buffers. Input sets (q, k, v: [rows|cols, heads, dim] f16
// device tensors) are registered once before timing; run(set, out) enqueues on the default stream.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "trisparse/trisparse.hpp"

namespace trisparse::bench {

class cusparse_pipeline {
 public:
  /// @throws std::runtime_error if cuSPARSE refuses the configuration.
  cusparse_pipeline(const csr_graph& pattern, std::int64_t heads, std::int64_t dim, bool fp32);
  ~cusparse_pipeline();
  cusparse_pipeline(const cusparse_pipeline&) = delete;
  cusparse_pipeline& operator=(const cusparse_pipeline&) = delete;
  /// Registers an input set (the fp32 path converts it here, outside any timing); returns its
  /// index.
  int add_inputs(const tensor_view& q, const tensor_view& k, const tensor_view& v);
  /// out: [rows, heads, dim] f32 device tensor.
  void run(int set, const tensor_view& out);
  std::string describe() const;

 private:
  struct state;
  std::unique_ptr<state> s_;
};

class dense_masked {
 public:
  /// Memory: rows * cols * (4 + 2 + 1/8) bytes.
  dense_masked(const csr_graph& pattern, std::int64_t heads, std::int64_t dim);
  ~dense_masked();
  dense_masked(const dense_masked&) = delete;
  dense_masked& operator=(const dense_masked&) = delete;
  int add_inputs(const tensor_view& q, const tensor_view& k, const tensor_view& v);
  void run(int set, const tensor_view& out);
  static std::size_t bytes_needed(const csr_graph& pattern);

 private:
  struct state;
  std::unique_ptr<state> s_;
};

/// cuSPARSE's SpMM and SDDMM (CSR, 32-bit indices) for one pattern and its values (1 when binary):
/// spmm: c[rows, n] (f32) = A b[cols, n]; sddmm: S = (x[rows, d] y[cols, d]^T) on A's entries.
/// fp32: A, b, x, y, S in f32; otherwise in f16 (S in f16 where cuSPARSE accepts it, else f32).
/// Dense operands are row-major and contiguous; run on the default stream.
class cusparse_kernels {
 public:
  /// @throws std::runtime_error if cuSPARSE refuses the configuration.
  cusparse_kernels(const csr_graph& pattern, bool fp32, std::int64_t n, std::int64_t d);
  ~cusparse_kernels();
  cusparse_kernels(const cusparse_kernels&) = delete;
  cusparse_kernels& operator=(const cusparse_kernels&) = delete;
  void spmm(const void* b, float* c);
  void sddmm(const void* x, const void* y);
  std::string describe() const;

 private:
  struct state;
  std::unique_ptr<state> s_;
};

/// Row softmax over f32 values in CSR entry order, one warp per row, on the default stream:
/// max-stabilised, or the naive exp / sum (FlashSparse's comparison; wrong once scores pass ~88).
class csr_softmax {
 public:
  explicit csr_softmax(const csr_graph& pattern);
  ~csr_softmax();
  csr_softmax(const csr_softmax&) = delete;
  csr_softmax& operator=(const csr_softmax&) = delete;
  void run(const float* in, float* out, bool stable);

 private:
  struct state;
  std::unique_ptr<state> s_;
};

/// Reads the device buffers `a` and `b` once (16-byte loads, 8 in flight a thread, two blocks of
/// 512 threads an SM) and keeps nothing: the floor of any kernel that must read both, such as the
/// top-k selection's pooling of Q and K. Sizes must be multiples of 16 bytes; default stream.
void read_once(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes);

/// Keeps the GPU busy for about `microseconds` so that what is enqueued after it is timed without
/// the host's issue time (events then bracket GPU work only).
void gpu_busy_wait(int microseconds);

}  // namespace trisparse::bench
