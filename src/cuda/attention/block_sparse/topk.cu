// Top-k block masks on the device (block routing, as topk_block_mask defines them on the CPU):
// one launch pools the block means of Q and K, one selects per (query block, head) the top_k key
// blocks by <mean Q, mean K> among those the block may attend, adds the diagonal block, and writes
// them in ascending order into the attention plan's blocks. Rows have fixed room (top_k + 1
// slots); unused slots hold the sequence's key-block count, whose first key lies past every
// row's last, so the attention kernels' walk ends there. No host synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "device_plan.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

struct topk_device_plan {
  std::shared_ptr<block_sparse_device_plan> attention;
  std::int32_t heads = 0, dim = 0, block = 0, top_k = 0, cap = 0;
  bool causal = false, keep_diagonal = false;
  std::int32_t q_blocks = 0, k_blocks = 0, max_k_blocks = 0, warps = 0, num_groups = 0;
  std::int64_t rows_q = 0, rows_k = 0;
  device_buffer<std::int32_t> q_block_seq, k_block_seq;    // the sequence of each block
  device_buffer<std::int32_t> q_block_base, k_block_base;  // per sequence: its first block
  device_buffer<int2> groups;               // the selection's blocks: (sequence, first query block)
  device_buffer<float> pooled_q, pooled_k;  // [blocks, heads, dim]
};

namespace {

struct pool_params {
  const void* q;
  const void* k;
  std::int64_t q_row, q_head, k_row, k_head;
  const std::int64_t* cu_q;
  const std::int64_t* cu_k;
  const std::int32_t *q_block_seq, *k_block_seq, *q_block_base, *k_block_base;
  float *pooled_q, *pooled_k;
  std::int32_t q_blocks, heads, dim, block;
};

constexpr int kPoolThreads = 256;

// Block x of the grid: query block x, or key block x - q_blocks. A row of all heads is
// heads * dim / 8 chunks of 8 values (16-byte loads); thread t sums chunk t % chunks of rows
// t / chunks, + groups, ... (groups = threads / chunks row groups, summed in a fixed order after,
// so the means are deterministic), or with more chunks than threads, chunks t, t + threads, ...
// of every row.
template <class T>
__global__ void __launch_bounds__(kPoolThreads) pool_kernel(const __grid_constant__ pool_params p) {
  __shared__ float partial[kPoolThreads * 8];
  const bool is_q = static_cast<std::int32_t>(blockIdx.x) < p.q_blocks;
  const int x = static_cast<int>(blockIdx.x) - (is_q ? 0 : p.q_blocks);
  const int b = (is_q ? p.q_block_seq : p.k_block_seq)[x];
  const int first = x - (is_q ? p.q_block_base : p.k_block_base)[b];
  const std::int64_t* cu = is_q ? p.cu_q : p.cu_k;
  const std::int64_t row0 = cu[b] + std::int64_t{first} * p.block;
  const int rows = static_cast<int>(min(std::int64_t{p.block}, cu[b + 1] - row0));
  const T* src = static_cast<const T*>(is_q ? p.q : p.k);
  const std::int64_t row_stride = is_q ? p.q_row : p.k_row,
                     head_stride = is_q ? p.q_head : p.k_head;
  float* dst = (is_q ? p.pooled_q : p.pooled_k) + std::int64_t{x} * p.heads * p.dim;
  const int chunks = p.heads * p.dim / 8, t = static_cast<int>(threadIdx.x);
  const int groups = max(1, kPoolThreads / chunks), group = t / chunks;
  const float inv = 1.f / static_cast<float>(rows);
  for (int chunk = t % chunks; chunk < chunks && group < groups; chunk += kPoolThreads) {
    const int c = chunk * 8;
    const T* col = src + row0 * row_stride + (c / p.dim) * head_stride + c % p.dim;
    float acc[8] = {};
#pragma unroll 4
    for (int i = group; i < rows; i += groups) {
      const uint4 raw = *reinterpret_cast<const uint4*>(col + i * row_stride);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += static_cast<float>(v[e]);
    }
    if (groups == 1) {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[c + e] = acc[e] * inv;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) partial[group * chunks * 8 + c + e] = acc[e];
    }
  }
  if (groups == 1) return;
  __syncthreads();
  for (int c = t; c < chunks * 8; c += kPoolThreads) {
    float acc = 0.f;
    for (int g = 0; g < groups; ++g) acc += partial[g * chunks * 8 + c];
    dst[c] = acc * inv;
  }
}

struct select_params {
  const float *pooled_q, *pooled_k;
  const std::int64_t* cu_q;
  const std::int64_t* cu_k;
  const std::int32_t *q_block_base, *k_block_base;
  const int2* groups;  // (sequence, first query block) of each block of warps
  std::int32_t* col_idx;
  std::int32_t heads, dim, block, top_k, cap, max_k_blocks, warps;
  bool causal, keep_diagonal;
};

constexpr int kChunk = 64;  // key blocks whose means a block stages at a time

// Shared floats per warp (a multiple of 4: 16-byte aligned): the pooled query row, the scores of
// the key blocks, the selection.
__host__ __device__ constexpr int warp_floats(int dim, int max_k_blocks, int cap) {
  return (dim + max_k_blocks + cap + 3) / 4 * 4;
}

// Shared floats: the staged key means ([kChunk][dim + 4]: 16-byte rows whose float4 reads by
// consecutive threads fall in distinct banks), then each warp's.
__host__ __device__ constexpr int select_floats(int warps, int dim, int max_k_blocks, int cap) {
  return kChunk * (dim + 4) + warps * warp_floats(dim, max_k_blocks, cap);
}

// A block of `warps` (2, 4 or 8) warps per (group of consecutive query blocks of one sequence,
// head), a warp per query block. Scores: the key-block means staged through shared memory, thread
// t scoring key block t % 64 of the chunk against the query rows of warps 2 (t / 64) and
// 2 (t / 64) + 1 (one read of the key row for two dot products). Then each warp: top_k rounds of a
// warp argmax (ties to the lower block; a chosen score becomes NaN, which later rounds skip), the
// diagonal, and the sorted write; unused slots get the key-block count.
__global__ void select_kernel(const __grid_constant__ select_params p) {
  extern __shared__ float4 shared4[];
  float* shared = reinterpret_cast<float*>(shared4);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const int2 group = p.groups[blockIdx.x / p.heads];
  const int b = group.x, r = group.y + warp;
  const int per_warp = warp_floats(p.dim, p.max_k_blocks, p.cap);
  float* staged = shared;
  const auto query_of = [&](int w) { return shared + kChunk * (p.dim + 4) + w * per_warp; };
  float* qv = query_of(warp);
  float* score = qv + p.dim;
  int* chosen = reinterpret_cast<int*>(score + p.max_k_blocks);
  const int lq = static_cast<int>(p.cu_q[b + 1] - p.cu_q[b]),
            lk = static_cast<int>(p.cu_k[b + 1] - p.cu_k[b]);
  const int nbq = (lq + p.block - 1) / p.block, nbk = (lk + p.block - 1) / p.block;
  // The key blocks query block rr may attend (0 past the sequence); the group's last row's (the
  // most: it grows with rr) bounds the staging loop.
  const auto allowed_of = [&](int rr) {
    if (rr >= nbq) return 0;
    const int last_row = min(lq, (rr + 1) * p.block) - 1;
    const int last = p.causal ? min(last_row + lk - lq, lk - 1) : lk - 1;
    return last < 0 ? 0 : last / p.block + 1;
  };
  const int allowed = allowed_of(r);
  const int most = allowed_of(min(group.y + p.warps, nbq) - 1);
  if (r < nbq) {
    const float* qs = p.pooled_q + ((std::int64_t{p.q_block_base[b]} + r) * p.heads + h) * p.dim;
    for (int d = lane; d < p.dim; d += 32) qv[d] = qs[d];
  }
  const std::int64_t k_stride = std::int64_t{p.heads} * p.dim;
  const float* kp = p.pooled_k + (std::int64_t{p.k_block_base[b]} * p.heads + h) * p.dim;
  const int key = static_cast<int>(threadIdx.x) % kChunk,
            w0 = 2 * (static_cast<int>(threadIdx.x) / kChunk);
  const int allowed0 = allowed_of(group.y + w0), allowed1 = allowed_of(group.y + w0 + 1);
  const float4* q0 = reinterpret_cast<const float4*>(query_of(w0));
  const float4* q1 = reinterpret_cast<const float4*>(query_of(w0 + 1));
  float* score0 = query_of(w0) + p.dim;
  float* score1 = query_of(w0 + 1) + p.dim;
  for (int c0 = 0; c0 < most; c0 += kChunk) {
    __syncthreads();  // the previous chunk's reads are done (and, first, the query rows written)
    const int n = min(kChunk, most - c0);
    for (int i = static_cast<int>(threadIdx.x); i < n * p.dim; i += 32 * p.warps)
      staged[(i / p.dim) * (p.dim + 4) + i % p.dim] = kp[(c0 + i / p.dim) * k_stride + i % p.dim];
    __syncthreads();
    const int c = c0 + key;
    if (c < max(allowed0, allowed1)) {
      const float4* kc = reinterpret_cast<const float4*>(staged + key * (p.dim + 4));
      float s0 = 0.f, s1 = 0.f;
      for (int d = 0; d < p.dim / 4; ++d) {
        const float4 k4 = kc[d], a = q0[d], e = q1[d];
        s0 = fmaf(a.x, k4.x, fmaf(a.y, k4.y, fmaf(a.z, k4.z, fmaf(a.w, k4.w, s0))));
        s1 = fmaf(e.x, k4.x, fmaf(e.y, k4.y, fmaf(e.z, k4.z, fmaf(e.w, k4.w, s1))));
      }
      if (c < allowed0) score0[c] = s0;
      if (c < allowed1) score1[c] = s1;
    }
  }
  __syncthreads();  // every warp's scores written
  if (r >= nbq) return;
  __syncwarp();
  const int keep = min(p.top_k, allowed);
  for (int i = 0; i < keep; ++i) {
    float best = -__builtin_huge_valf();
    int at = INT_MAX;
    for (int c = lane; c < allowed; c += 32) {
      const float v = score[c];
      if (v == v && (v > best || (v == best && c < at))) {
        best = v;
        at = c;
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oa = __shfl_xor_sync(0xffffffffu, at, off);
      if (ob > best || (ob == best && oa < at)) {
        best = ob;
        at = oa;
      }
    }
    __syncwarp();  // every lane's scan of the scores is done before one is overwritten
    if (lane == 0) {
      chosen[i] = at;
      score[at] = __int_as_float(0x7fffffff);
    }
    __syncwarp();
  }
  const int aligned = min(lq, (r + 1) * p.block) - 1 + lk - lq;
  int n = keep;
  if (p.keep_diagonal && aligned >= 0 && lk > 0) {
    const int diagonal = min(aligned, lk - 1) / p.block;  // < allowed: its score is set
    if (score[diagonal] == score[diagonal]) {
      if (lane == 0) chosen[n] = diagonal;
      ++n;
    }
  }
  __syncwarp();
  std::int32_t* out =
      p.col_idx + (std::int64_t{p.q_block_base[b]} * p.heads + std::int64_t{h} * nbq + r) * p.cap;
  for (int i = lane; i < p.cap; i += 32) {
    if (i < n) {
      const int v = chosen[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += chosen[j] < v;
      out[rank] = v;
    } else {
      out[i] = nbk;
    }
  }
}

void check_input(const topk_device_plan& t, const tensor_view& v, std::int64_t rows,
                 const char* name) {
  if (v.where != device_kind::cuda || v.rows != rows || v.heads != t.heads || v.dim != t.dim ||
      (v.type != dtype::f16 && v.type != dtype::bf16)) {
    throw invalid_input(std::string("top-k selection: ") + name + " must be a CUDA f16 or bf16 [" +
                        std::to_string(rows) + ", " + std::to_string(t.heads) + ", " +
                        std::to_string(t.dim) + "] tensor");
  }
  check_16byte_rows(v, name);
}

}  // namespace

std::shared_ptr<topk_device_plan> make_topk_plan(const block_sparse_mask& skeleton,
                                                 std::int64_t top_k, bool keep_diagonal,
                                                 std::int64_t dim, block_kernel kernel,
                                                 stream_ref stream) {
  if (dim % 8 != 0) {
    throw invalid_input("top-k selection: head_dim must be a multiple of 8, not " +
                        std::to_string(dim));
  }
  auto t = std::make_shared<topk_device_plan>();
  t->attention = make_block_sparse_plan(skeleton, kernel, stream);
  t->heads = static_cast<std::int32_t>(skeleton.heads);
  t->dim = static_cast<std::int32_t>(dim);
  t->block = static_cast<std::int32_t>(skeleton.block);
  t->top_k = static_cast<std::int32_t>(top_k);
  t->cap = static_cast<std::int32_t>(top_k + (keep_diagonal ? 1 : 0));
  t->causal = skeleton.causal;
  t->keep_diagonal = keep_diagonal;
  t->rows_q = skeleton.cu_seqlens_q.back();
  t->rows_k = skeleton.cu_seqlens_k.back();
  std::vector<std::int32_t> q_seq, k_seq, q_base, k_base;
  for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
    const auto nbq = static_cast<std::int32_t>((skeleton.len_q(b) + t->block - 1) / t->block),
               nbk = static_cast<std::int32_t>((skeleton.len_k(b) + t->block - 1) / t->block);
    q_base.push_back(static_cast<std::int32_t>(q_seq.size()));
    k_base.push_back(static_cast<std::int32_t>(k_seq.size()));
    q_seq.insert(q_seq.end(), static_cast<std::size_t>(nbq), static_cast<std::int32_t>(b));
    k_seq.insert(k_seq.end(), static_cast<std::size_t>(nbk), static_cast<std::int32_t>(b));
    t->max_k_blocks = std::max(t->max_k_blocks, nbk);
  }
  t->q_blocks = static_cast<std::int32_t>(q_seq.size());
  t->k_blocks = static_cast<std::int32_t>(k_seq.size());
  // Warps per selection block: the most of 8, 4, 2 whose scores fit in shared memory.
  int device = 0, limit = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  for (const int w : {8, 4, 2}) {
    if (select_floats(w, t->dim, t->max_k_blocks, t->cap) * 4 <= limit) {
      t->warps = w;
      break;
    }
  }
  if (t->warps == 0) {
    throw not_supported("top-k selection: " + std::to_string(t->max_k_blocks) +
                        " key blocks in one sequence need more shared memory than the device has");
  }
  TRISPARSE_CUDA_TRY(
      cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           select_floats(t->warps, t->dim, t->max_k_blocks, t->cap) * 4));
  std::vector<int2> groups;
  for (std::int64_t b = 0; b < skeleton.batch(); ++b) {
    const auto nbq = static_cast<int>((skeleton.len_q(b) + t->block - 1) / t->block);
    for (int r = 0; r < nbq; r += t->warps) groups.push_back({static_cast<int>(b), r});
  }
  t->num_groups = static_cast<std::int32_t>(groups.size());
  t->groups = device_buffer<int2>(groups);
  t->q_block_seq = device_buffer<std::int32_t>(q_seq);
  t->k_block_seq = device_buffer<std::int32_t>(k_seq);
  t->q_block_base = device_buffer<std::int32_t>(q_base);
  t->k_block_base = device_buffer<std::int32_t>(k_base);
  t->pooled_q = device_buffer<float>(static_cast<std::size_t>(t->q_blocks) * t->heads * t->dim);
  t->pooled_k = device_buffer<float>(static_cast<std::size_t>(t->k_blocks) * t->heads * t->dim);
  return t;
}

const block_sparse_device_plan& attention_of(const topk_device_plan& t) { return *t.attention; }

void select_topk(topk_device_plan& t, const tensor_view& q, const tensor_view& k,
                 stream_ref stream) {
  check_input(t, q, t.rows_q, "q");
  check_input(t, k, t.rows_k, "k");
  if (k.type != q.type) throw invalid_input("top-k selection: q and k need the same dtype");
  expect_current_device(t.attention->device);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  block_sparse_device_plan& a = *t.attention;
  const pool_params pp{q.data,
                       k.data,
                       q.row_stride,
                       q.head_stride,
                       k.row_stride,
                       k.head_stride,
                       a.cu_q.data(),
                       a.cu_k.data(),
                       t.q_block_seq.data(),
                       t.k_block_seq.data(),
                       t.q_block_base.data(),
                       t.k_block_base.data(),
                       t.pooled_q.data(),
                       t.pooled_k.data(),
                       t.q_blocks,
                       t.heads,
                       t.dim,
                       t.block};
  const unsigned pool_blocks = static_cast<unsigned>(t.q_blocks + t.k_blocks);
  if (pool_blocks == 0) return;
  if (q.type == dtype::f16)
    pool_kernel<__half><<<pool_blocks, 256, 0, s>>>(pp);
  else
    pool_kernel<__nv_bfloat16><<<pool_blocks, 256, 0, s>>>(pp);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  select_params sp{};
  sp.pooled_q = t.pooled_q.data();
  sp.pooled_k = t.pooled_k.data();
  sp.cu_q = a.cu_q.data();
  sp.cu_k = a.cu_k.data();
  sp.q_block_base = t.q_block_base.data();
  sp.k_block_base = t.k_block_base.data();
  sp.groups = t.groups.data();
  sp.col_idx = a.col_idx.data();
  sp.heads = t.heads;
  sp.dim = t.dim;
  sp.block = t.block;
  sp.top_k = t.top_k;
  sp.cap = t.cap;
  sp.max_k_blocks = t.max_k_blocks;
  sp.warps = t.warps;
  sp.causal = t.causal;
  sp.keep_diagonal = t.keep_diagonal;
  const std::int64_t blocks = std::int64_t{t.num_groups} * t.heads;
  if (blocks == 0 || t.cap == 0) return;
  select_kernel<<<static_cast<unsigned>(blocks), 32 * t.warps,
                  select_floats(t.warps, t.dim, t.max_k_blocks, t.cap) * 4, s>>>(sp);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

std::vector<std::int32_t> download_blocks(const topk_device_plan& t, stream_ref stream) {
  std::vector<std::int32_t> cols(t.attention->col_idx.size());
  const auto s = static_cast<cudaStream_t>(stream.handle);
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(cols.data(), t.attention->col_idx.data(),
                                     cols.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return cols;
}

}  // namespace trisparse::cuda
