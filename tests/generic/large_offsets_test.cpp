// Element offsets past 2^31 (issue 62): the ops on views whose rows lie more than 2^31 elements
// apart, and on tensors of more than 2^31 elements (a few rows of very many heads). A 32-bit
// product anywhere in an offset shows as a result that differs from the same op on a compact copy
// (strided views) or as a write into, or a read from, the wrong head (many heads). Built twice:
// large_tests (the CPU engines; the regions are anonymous mappings whose untouched pages cost no
// memory) and large_gpu_tests (CUDA; label gpu, skipped without a device).
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

#ifdef TRISPARSE_LARGE_CUDA
#include <cuda_runtime.h>
#endif

namespace trisparse {
namespace {

#ifdef TRISPARSE_LARGE_CUDA
constexpr device_kind kWhere = device_kind::cuda;
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#else
constexpr device_kind kWhere = device_kind::cpu;
#endif

constexpr std::int64_t k2to31 = std::int64_t{1} << 31;

// Zeroed memory of `bytes` on the device under test: on the CPU an anonymous mapping (pages cost
// memory once written), on CUDA cudaMalloc'd and cleared.
class region {
 public:
  explicit region(std::size_t bytes) : bytes_(bytes) {
#ifdef TRISPARSE_LARGE_CUDA
    check_cuda(cudaMalloc(&data_, bytes), "cudaMalloc");
    check_cuda(cudaMemset(data_, 0, bytes), "cudaMemset");
#else
    data_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data_ == MAP_FAILED)
      throw std::runtime_error("mmap of " + std::to_string(bytes) + " bytes");
#endif
  }
  ~region() {
#ifdef TRISPARSE_LARGE_CUDA
    cudaFree(data_);
#else
    munmap(data_, bytes_);
#endif
  }
  region(const region&) = delete;
  region& operator=(const region&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  void put(std::size_t at, const void* src, std::size_t n) {
#ifdef TRISPARSE_LARGE_CUDA
    check_cuda(cudaMemcpy(data() + at, src, n, cudaMemcpyHostToDevice), "put");
#else
    std::memcpy(data() + at, src, n);
#endif
  }
  void get(std::size_t at, void* dst, std::size_t n) const {
#ifdef TRISPARSE_LARGE_CUDA
    check_cuda(cudaDeviceSynchronize(), "kernel");
    check_cuda(cudaMemcpy(dst, data() + at, n, cudaMemcpyDeviceToHost), "get");
#else
    std::memcpy(dst, data() + at, n);
#endif
  }
  // 0xFF bytes (NaN in every float type) over the view's elements: unwritten outputs show.
  void poison(std::size_t at, std::size_t n) {
#ifdef TRISPARSE_LARGE_CUDA
    check_cuda(cudaMemset(data() + at, 0xFF, n), "poison");
#else
    std::memset(data() + at, 0xFF, n);
#endif
  }

 private:
  std::size_t bytes_;
  void* data_ = nullptr;
};

// A [rows, heads, dim] tensor in a region of its own, rows `row_stride` elements apart.
struct big {
  tensor_view view;
  std::unique_ptr<region> mem;
  big(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim, std::int64_t row_stride) {
    const std::int64_t elements = (rows - 1) * row_stride + heads * dim;
    mem = std::make_unique<region>(static_cast<std::size_t>(elements) * size_of(t));
    view = tensor_view::contiguous(mem->data(), t, rows, heads, dim);
    view.row_stride = row_stride;
    view.where = kWhere;
  }
  std::size_t row_bytes() const { return view.heads * view.dim * size_of(view.type); }
  std::size_t at(std::int64_t r, std::int64_t h = 0) const {
    return static_cast<std::size_t>(view.offset(r, h, 0)) * size_of(view.type);
  }
  // Rows of a compact host tensor of the same shape into the view.
  void load(const host_tensor& h) {
    for (std::int64_t r = 0; r < view.rows; ++r)
      mem->put(at(r), h.data() + static_cast<std::size_t>(r) * row_bytes(), row_bytes());
  }
  void poison() {
    for (std::int64_t r = 0; r < view.rows; ++r) mem->poison(at(r), row_bytes());
  }
  // The view's rows as a compact host tensor.
  host_tensor fetch() const {
    host_tensor h(view.type, view.rows, view.heads, view.dim);
    for (std::int64_t r = 0; r < view.rows; ++r)
      mem->get(at(r), h.data() + static_cast<std::size_t>(r) * row_bytes(), row_bytes());
    return h;
  }
};

// Rows spread so that the last starts past 2^31 elements (a multiple of 64: aligned rows).
std::int64_t spread(std::int64_t rows) { return (k2to31 / (rows - 1) / 64 + 1) * 64; }

// A compact tensor on the device under test (the reference run's operand).
struct compact {
  host_tensor host;
  std::optional<device_tensor> dev;
  explicit compact(const host_tensor& h) : host(h) {
    if (kWhere == device_kind::cuda) dev.emplace(host);
  }
  compact(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim)
      : compact(host_tensor(t, rows, heads, dim)) {}
  tensor_view view() { return dev ? dev->view() : host.view(); }
  host_tensor fetch() const { return dev ? dev->to_host() : host; }
};

void expect_same_bits(const host_tensor& got, const host_tensor& want, const std::string& what) {
  ASSERT_EQ(got.size_bytes(), want.size_bytes()) << what;
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.get(i), b = want.get(i);
    differ += !(a == b || (std::isnan(a) && std::isnan(b)));
  }
  EXPECT_EQ(differ, 0) << what << ": elements differ from the compact run";
  for (std::int64_t i = 0; i < got.numel(); ++i)
    ASSERT_FALSE(std::isnan(got.get(i))) << what << ": unwritten at " << i;
}

host_tensor random(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim,
                   std::uint64_t seed) {
  host_tensor h(t, rows, heads, dim);
  h.fill_uniform(-1.0, 1.0, seed);
  return h;
}

#define SKIP_WITHOUT_DEVICE()                             \
  if (kWhere == device_kind::cuda && !cuda_available()) { \
    GTEST_SKIP() << "no CUDA device visible: skipping";   \
  }

// --- rows more than 2^31 elements apart ---------------------------------------------------------

TEST(LargeOffsets, AttentionForwardAndBackwardOnSpreadRows) {
  SKIP_WITHOUT_DEVICE();
  const csr_graph g = test::random_pattern(80, 70, 12, 3);
  const std::int64_t heads = 2, dim = 64;
  const dtype in = dtype::f16, grad = dtype::f32;
  const auto plan = attention_plan::build(g, kWhere, {.gradients = true});
  const host_tensor hq = random(in, g.rows, heads, dim, 1), hk = random(in, g.cols, heads, dim, 2),
                    hv = random(in, g.cols, heads, dim, 3), hd = random(in, g.rows, heads, dim, 4);
  // The compact run.
  compact q(hq), k(hk), v(hv), dout(hd), out(in, g.rows, heads, dim),
      lse(dtype::f32, g.rows, heads, 1), dq(grad, g.rows, heads, dim), dk(grad, g.cols, heads, dim),
      dv(grad, g.cols, heads, dim);
  plan.run(q.view(), k.view(), v.view(), out.view(), {.lse = lse.view()});
  plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                dk.view(), dv.view());
  // The same on views whose rows lie spread(rows) elements apart.
  big bq(in, g.rows, heads, dim, spread(g.rows)), bk(in, g.cols, heads, dim, spread(g.cols)),
      bv(in, g.cols, heads, dim, spread(g.cols)), bd(in, g.rows, heads, dim, spread(g.rows)),
      bo(in, g.rows, heads, dim, spread(g.rows)), bl(dtype::f32, g.rows, heads, 1, spread(g.rows)),
      bdq(grad, g.rows, heads, dim, spread(g.rows)), bdk(grad, g.cols, heads, dim, spread(g.cols)),
      bdv(grad, g.cols, heads, dim, spread(g.cols));
  bq.load(hq), bk.load(hk), bv.load(hv), bd.load(hd);
  for (big* b : {&bo, &bl, &bdq, &bdk, &bdv}) b->poison();
  plan.run(bq.view, bk.view, bv.view, bo.view, {.lse = bl.view});
  plan.backward(bq.view, bk.view, bv.view, bo.view, bl.view, bd.view, bdq.view, bdk.view, bdv.view);
  expect_same_bits(bo.fetch(), out.fetch(), "out");
  expect_same_bits(bl.fetch(), lse.fetch(), "lse");
  expect_same_bits(bdq.fetch(), dq.fetch(), "dq");
  expect_same_bits(bdk.fetch(), dk.fetch(), "dk");
  expect_same_bits(bdv.fetch(), dv.fetch(), "dv");
}

TEST(LargeOffsets, SpmmAndSddmmOnSpreadRows) {
  SKIP_WITHOUT_DEVICE();
  csr_graph g = test::random_pattern(90, 75, 10, 5);
  g.values.assign(static_cast<std::size_t>(g.nnz()), 0.75f);
  const std::int64_t heads = 2, dim = 40;
  const auto plan = sparse_plan::build(g, kWhere);
  const host_tensor hb = random(dtype::f16, g.cols, heads, dim, 6),
                    hx = random(dtype::f16, g.rows, heads, dim, 7);
  compact b(hb), x(hx), c(dtype::f32, g.rows, heads, dim),
      s(dtype::f32, std::max<std::int64_t>(plan.slots(), 1) * heads, 1, 1);
  tensor_view slots = s.view();
  slots.rows = plan.slots();
  slots.heads = heads;
  slots.row_stride = 1;
  slots.head_stride = std::max<std::int64_t>(plan.slots(), 1);
  plan.spmm({}, b.view(), c.view());
  plan.sddmm(x.view(), b.view(), slots, 0.5);
  big bb(dtype::f16, g.cols, heads, dim, spread(g.cols)),
      bx(dtype::f16, g.rows, heads, dim, spread(g.rows)),
      bc(dtype::f32, g.rows, heads, dim, spread(g.rows));
  bb.load(hb), bx.load(hx), bc.poison();
  compact s2(dtype::f32, std::max<std::int64_t>(plan.slots(), 1) * heads, 1, 1);
  tensor_view slots2 = slots;
  slots2.data = s2.view().data;
  plan.spmm({}, bb.view, bc.view);
  plan.sddmm(bx.view, bb.view, slots2, 0.5);
  expect_same_bits(bc.fetch(), c.fetch(), "spmm c");
  expect_same_bits(s2.fetch(), s.fetch(), "sddmm scores");
}

TEST(LargeOffsets, BlockSparseOnSpreadRows) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<std::int64_t> lens{70, 33};
  const auto mask = make_block_sparse_mask(
      {.layout = block_layout::random, .block = 16, .p = 0.4, .heads = 2, .seed = 8}, lens);
  const std::int64_t rows = mask.cu_seqlens_q.back(), heads = 2, dim = 64;
  const auto plan = block_sparse_attention_plan::build(mask, kWhere, {.gradients = true});
  const dtype in = dtype::f16;
  const host_tensor hq = random(in, rows, heads, dim, 9), hk = random(in, rows, heads, dim, 10),
                    hv = random(in, rows, heads, dim, 11), hd = random(in, rows, heads, dim, 12);
  compact q(hq), k(hk), v(hv), dout(hd), out(in, rows, heads, dim), lse(dtype::f32, rows, heads, 1),
      dq(dtype::f32, rows, heads, dim), dk(dtype::f32, rows, heads, dim),
      dv(dtype::f32, rows, heads, dim);
  // The log-sum-exp where the plan writes one (the CUDA kernels); the CPU recomputes it.
  const bool with_lse = plan.report().algo == algorithm::block;
  plan.run(q.view(), k.view(), v.view(), out.view(),
           {.lse = with_lse ? lse.view() : tensor_view{}});
  plan.backward(q.view(), k.view(), v.view(), out.view(), with_lse ? lse.view() : tensor_view{},
                dout.view(), dq.view(), dk.view(), dv.view());
  const std::int64_t s = spread(rows);
  big bq(in, rows, heads, dim, s), bk(in, rows, heads, dim, s), bv(in, rows, heads, dim, s),
      bd(in, rows, heads, dim, s), bo(in, rows, heads, dim, s), bl(dtype::f32, rows, heads, 1, s),
      bdq(dtype::f32, rows, heads, dim, s), bdk(dtype::f32, rows, heads, dim, s),
      bdv(dtype::f32, rows, heads, dim, s);
  bq.load(hq), bk.load(hk), bv.load(hv), bd.load(hd);
  for (big* b : {&bo, &bl, &bdq, &bdk, &bdv}) b->poison();
  plan.run(bq.view, bk.view, bv.view, bo.view, {.lse = with_lse ? bl.view : tensor_view{}});
  plan.backward(bq.view, bk.view, bv.view, bo.view, with_lse ? bl.view : tensor_view{}, bd.view,
                bdq.view, bdk.view, bdv.view);
  expect_same_bits(bo.fetch(), out.fetch(), "out");
  if (with_lse) expect_same_bits(bl.fetch(), lse.fetch(), "lse");
  expect_same_bits(bdq.fetch(), dq.fetch(), "dq");
  expect_same_bits(bdk.fetch(), dk.fetch(), "dk");
  expect_same_bits(bdv.fetch(), dv.fetch(), "dv");
}

TEST(LargeOffsets, GatForwardAndBackwardOnSpreadRows) {
  SKIP_WITHOUT_DEVICE();
  const csr_graph g = test::random_pattern(75, 85, 9, 16);
  const std::int64_t heads = 3, width = 24;
  const dtype t = dtype::f16, o = dtype::f32;
  const auto plan = gat_plan::build(g, kWhere);
  const host_tensor hx = random(t, g.cols, heads, width, 17),
                    hs = random(dtype::f32, g.cols, heads, 1, 18),
                    ht = random(dtype::f32, g.rows, heads, 1, 19),
                    hd = random(o, g.rows, heads, width, 20);
  compact x(hx), a_src(hs), a_dst(ht), dout(hd), out(o, g.rows, heads, width),
      lse(dtype::f32, g.rows, heads, 1), dx(o, g.cols, heads, width),
      da_src(dtype::f32, g.cols, heads, 1), da_dst(dtype::f32, g.rows, heads, 1);
  // Workspaces sized for either run (the same heads and width).
  const std::size_t fb = plan.forward_workspace_bytes(heads, width),
                    bb = plan.backward_workspace_bytes(heads, width);
  std::optional<region> fws, bws;
  if (fb > 0) fws.emplace(fb);
  if (bb > 0) bws.emplace(bb);
  const workspace_view fw{fws ? fws->data() : nullptr, fb}, bw{bws ? bws->data() : nullptr, bb};
  plan.forward({.x = x.view(),
                .a_src = a_src.view(),
                .a_dst = a_dst.view(),
                .out = out.view(),
                .lse = lse.view()},
               {}, fw);
  plan.backward({.x = x.view(),
                 .a_src = a_src.view(),
                 .a_dst = a_dst.view(),
                 .out = out.view(),
                 .lse = lse.view(),
                 .dout = dout.view(),
                 .dx = dx.view(),
                 .da_src = da_src.view(),
                 .da_dst = da_dst.view()},
                {}, bw);
  const std::int64_t sr = spread(g.rows), sc = spread(g.cols);
  big bx(t, g.cols, heads, width, sc), bs(dtype::f32, g.cols, heads, 1, sc),
      bt(dtype::f32, g.rows, heads, 1, sr), bd(o, g.rows, heads, width, sr),
      bo(o, g.rows, heads, width, sr), bl(dtype::f32, g.rows, heads, 1, sr),
      bdx(o, g.cols, heads, width, sc), bds(dtype::f32, g.cols, heads, 1, sc),
      bdt(dtype::f32, g.rows, heads, 1, sr);
  bx.load(hx), bs.load(hs), bt.load(ht), bd.load(hd);
  for (big* b : {&bo, &bl, &bdx, &bds, &bdt}) b->poison();
  plan.forward({.x = bx.view, .a_src = bs.view, .a_dst = bt.view, .out = bo.view, .lse = bl.view},
               {}, fw);
  plan.backward({.x = bx.view,
                 .a_src = bs.view,
                 .a_dst = bt.view,
                 .out = bo.view,
                 .lse = bl.view,
                 .dout = bd.view,
                 .dx = bdx.view,
                 .da_src = bds.view,
                 .da_dst = bdt.view},
                {}, bw);
  expect_same_bits(bo.fetch(), out.fetch(), "out");
  expect_same_bits(bl.fetch(), lse.fetch(), "lse");
  expect_same_bits(bdx.fetch(), dx.fetch(), "dx");
  expect_same_bits(bds.fetch(), da_src.fetch(), "da_src");
  expect_same_bits(bdt.fetch(), da_dst.fetch(), "da_dst");
}

// --- more than 2^31 elements: a few rows of very many heads --------------------------------------

// Available memory in bytes (the CPU case writes its outputs), from /proc/meminfo.
std::int64_t available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// Heads that carry data (the others are zero): the first, some in the middle and the last, past
// 2^31 elements.
std::vector<std::int64_t> data_heads(std::int64_t heads) {
  return {0, 1, heads / 2, heads / 2 + 7, heads - 2, heads - 1};
}

// The value of an f16 or f32 word.
double value_of(std::uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double x = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return h & 0x8000u ? -x : x;
}
double value_of(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// Every element of the big output (f16 or f32) finite, zero outside the data heads, and the data
// heads equal to `want` [rows, hs.size(), dim]: the compact run over those heads alone, bit for bit
// (tol == 0), or the float64 reference within `tol` normwise per head (where the kernel's order of
// key blocks depends on the head count).
template <class Word, Word kExponent>
void expect_heads_as(const big& got, const host_tensor& want, const std::vector<std::int64_t>& hs,
                     const std::string& what, double tol) {
  constexpr Word kMagnitude = static_cast<Word>(~Word{0} >> 1);
  const std::int64_t heads = got.view.heads, dim = got.view.dim;
  const auto n = static_cast<std::int64_t>(hs.size());
  std::vector<Word> row(static_cast<std::size_t>(heads * dim));
  std::vector<char> has_data(static_cast<std::size_t>(heads), 0);
  for (const std::int64_t h : hs) has_data[static_cast<std::size_t>(h)] = 1;
  if (tol == 0) {
    ASSERT_EQ(want.type(), got.view.type);
  }
  const auto* w = reinterpret_cast<const Word*>(want.data());
  std::int64_t non_finite = 0, stray = 0, differ = 0;
  std::vector<std::pair<double, double>> normwise(hs.size(), {0.0, 0.0});
  for (std::int64_t r = 0; r < got.view.rows; ++r) {
    got.mem->get(got.at(r), row.data(), got.row_bytes());
#pragma omp parallel for reduction(+ : non_finite, stray)
    for (std::int64_t e = 0; e < heads * dim; ++e) {
      const Word x = row[static_cast<std::size_t>(e)];
      non_finite += (x & kExponent) == kExponent;
      stray += !has_data[static_cast<std::size_t>(e / dim)] && (x & kMagnitude) != 0;
    }
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t d = 0; d < dim; ++d) {
        const Word a = row[static_cast<std::size_t>(hs[i] * dim + d)];
        const std::int64_t at = (r * n + i) * dim + d;
        if (tol == 0) {
          differ += a != w[at];
          continue;
        }
        auto& [err, size] = normwise[static_cast<std::size_t>(i)];
        err = std::max(err, std::abs(value_of(a) - want.get(at)));
        size = std::max(size, std::abs(want.get(at)));
      }
  }
  EXPECT_EQ(non_finite, 0) << what << ": unwritten or non-finite elements";
  EXPECT_EQ(stray, 0) << what << ": nonzero elements in heads without data";
  EXPECT_EQ(differ, 0) << what << ": data heads differ from the compact run";
  for (std::int64_t i = 0; i < n && tol > 0; ++i) {
    const auto [err, size] = normwise[static_cast<std::size_t>(i)];
    EXPECT_LE(err, tol * size) << what << ": head " << hs[i] << " differs by " << err
                               << " from float64 (largest value " << size << ")";
  }
}

void expect_heads(const big& got, const host_tensor& want, const std::vector<std::int64_t>& hs,
                  const std::string& what, double tol = 0) {
  if (got.view.type == dtype::f16) {
    expect_heads_as<std::uint16_t, 0x7C00u>(got, want, hs, what, tol);
  } else {
    ASSERT_EQ(got.view.type, dtype::f32);
    expect_heads_as<std::uint32_t, 0x7F800000u>(got, want, hs, what, tol);
  }
}

// A [rows, heads, dim] tensor of heads * dim elements a row, zero but for the heads `hs`, which
// hold the compact `data` [rows, hs.size(), dim].
std::unique_ptr<big> heads_of(const host_tensor& data, std::int64_t heads,
                              const std::vector<std::int64_t>& hs) {
  const std::int64_t dim = data.dim(), n = static_cast<std::int64_t>(hs.size());
  auto b = std::make_unique<big>(data.type(), data.rows(), heads, dim, heads * dim);
  const std::size_t bytes = static_cast<std::size_t>(dim) * size_of(data.type());
  for (std::int64_t r = 0; r < data.rows(); ++r)
    for (std::int64_t i = 0; i < n; ++i)
      b->mem->put(b->at(r, hs[i]), data.data() + static_cast<std::size_t>(r * n + i) * bytes,
                  bytes);
  return b;
}

// A big output, poisoned: an element the op leaves unwritten shows as NaN.
std::unique_ptr<big> big_output(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  auto b = std::make_unique<big>(t, rows, heads, dim, heads * dim);
  b->poison();
  return b;
}

workspace_view workspace_of(std::optional<region>& r, std::size_t bytes) {
  if (bytes > 0) r.emplace(bytes);
  return {r ? r->data() : nullptr, bytes};
}

// The CPU runs these in f32 (its engines would hold fp32 copies of 16-bit inputs) where memory
// allows: 6 tensors' worth, the outputs' pages mapped as they are written.
bool skip_for_memory(std::size_t tensor_bytes) {
  return kWhere == device_kind::cpu &&
         available_bytes() < static_cast<std::int64_t>(6 * tensor_bytes);
}

TEST(LargeOffsets, AttentionAndSpmmOnMoreThan2to31Elements) {
  SKIP_WITHOUT_DEVICE();
  // Three rows (one empty), a repeated column; 2^31 + 3 * 64 elements a tensor.
  coo_graph coo;
  coo.rows = coo.cols = 3;
  coo.src = {0, 0, 2, 2, 2};
  coo.dst = {0, 2, 1, 2, 0};
  const csr_graph g = to_csr(coo);
  const std::int64_t dim = 64, heads = k2to31 / (g.rows * dim) + 1;
  const dtype t = kWhere == device_kind::cuda ? dtype::f16 : dtype::f32, grad = dtype::f32;
  const std::size_t bytes = static_cast<std::size_t>(g.rows * heads * dim) * size_of(grad);
  if (skip_for_memory(bytes))
    GTEST_SKIP() << "needs " << 6 * bytes / (1 << 30) << " GiB of free memory: skipping";
  const std::vector<std::int64_t> hs = data_heads(heads);
  const auto n = static_cast<std::int64_t>(hs.size());
  const host_tensor sq = random(t, g.rows, n, dim, 13), sk = random(t, g.cols, n, dim, 14),
                    sv = random(t, g.cols, n, dim, 15), sd = random(t, g.rows, n, dim, 16);
  // The compact run over the data heads alone.
  const auto plan = attention_plan::build(g, kWhere, {.gradients = true});
  compact q(sq), k(sk), v(sv), dout(sd), out(t, g.rows, n, dim), lse(dtype::f32, g.rows, n, 1),
      dq(grad, g.rows, n, dim), dk(grad, g.cols, n, dim), dv(grad, g.cols, n, dim);
  plan.run(q.view(), k.view(), v.view(), out.view(), {.lse = lse.view()});
  plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                dk.view(), dv.view());
  // The big tensors: zero but for the data heads.
  const auto bq = heads_of(sq, heads, hs), bk = heads_of(sk, heads, hs),
             bv = heads_of(sv, heads, hs), bd = heads_of(sd, heads, hs);
  {
    const auto bo = big_output(t, g.rows, heads, dim),
               bl = big_output(dtype::f32, g.rows, heads, 1);
    std::optional<region> ws;
    plan.run(bq->view, bk->view, bv->view, bo->view, {.lse = bl->view}, {},
             workspace_of(ws, plan.workspace_bytes(heads, dim)));
    expect_heads(*bo, out.fetch(), hs, "attention out");
    const auto bdq = big_output(grad, g.rows, heads, dim),
               bdk = big_output(grad, g.cols, heads, dim),
               bdv = big_output(grad, g.cols, heads, dim);
    std::optional<region> bws;
    plan.backward(bq->view, bk->view, bv->view, bo->view, bl->view, bd->view, bdq->view, bdk->view,
                  bdv->view, {}, {}, workspace_of(bws, plan.backward_workspace_bytes(heads, dim)));
    expect_heads(*bdq, dq.fetch(), hs, "dq");
    expect_heads(*bdk, dk.fetch(), hs, "dk");
    expect_heads(*bdv, dv.fetch(), hs, "dv");
  }
  // SpMM with the pattern's values (1): c = A v.
  const auto sparse = sparse_plan::build(g, kWhere);
  compact c(t, g.rows, n, dim);
  sparse.spmm({}, v.view(), c.view());
  const auto bc = big_output(t, g.rows, heads, dim);
  std::optional<region> ws;
  sparse.spmm({}, bv->view, bc->view, {}, workspace_of(ws, sparse.workspace_bytes(heads, dim)));
  expect_heads(*bc, c.fetch(), hs, "spmm c");
}

TEST(LargeOffsets, BlockSparseOnMoreThan2to31Elements) {
  SKIP_WITHOUT_DEVICE();
  // Two sequences (40 and 24 rows) under one mask shared by every head.
  const std::vector<std::int64_t> lens{40, 24};
  const auto mask = make_block_sparse_mask(
      {.layout = block_layout::random, .block = 16, .p = 0.3, .heads = 1, .seed = 21}, lens);
  const std::int64_t rows = mask.cu_seqlens_q.back(), dim = 64, heads = k2to31 / (rows * dim) + 1;
  const dtype t = kWhere == device_kind::cuda ? dtype::f16 : dtype::f32;
  const std::size_t bytes = static_cast<std::size_t>(rows * heads * dim) * size_of(t);
  if (skip_for_memory(bytes))
    GTEST_SKIP() << "needs " << 6 * bytes / (1 << 30) << " GiB of free memory: skipping";
  const std::vector<std::int64_t> hs = data_heads(heads);
  const auto n = static_cast<std::int64_t>(hs.size());
  const host_tensor sq = random(t, rows, n, dim, 22), sk = random(t, rows, n, dim, 23),
                    sv = random(t, rows, n, dim, 24);
  const auto plan = block_sparse_attention_plan::build(mask, kWhere);
  compact q(sq), k(sk), v(sv), out(t, rows, n, dim);
  plan.run(q.view(), k.view(), v.view(), out.view());
  const auto bq = heads_of(sq, heads, hs), bk = heads_of(sk, heads, hs),
             bv = heads_of(sv, heads, hs), bo = big_output(t, rows, heads, dim);
  std::optional<region> ws;
  plan.run(bq->view, bk->view, bv->view, bo->view, {}, {},
           workspace_of(ws, plan.workspace_bytes(heads, dim)));
  if (kWhere == device_kind::cpu) {
    expect_heads(*bo, out.fetch(), hs, "block-sparse out");
  } else {
    // The later waves of thread blocks walk their key blocks downwards (L2 reuse), so heads past
    // the first wave sum in another order than a compact run's: checked against float64 instead.
    host_tensor want(dtype::f64, rows, n, dim);
    reference::block_sparse_attention(mask, sq.view(), sk.view(), sv.view(), want.view(),
                                      effective_scale({}, dim));
    expect_heads(*bo, want, hs, "block-sparse out", 4 * 2 * unit_roundoff(t) + 1e-5);
  }
}

}  // namespace
}  // namespace trisparse
