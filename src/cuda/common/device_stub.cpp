// Without the CUDA backend there are no devices and no CUDA plans.
#include "../attention/block_sparse/plan.hpp"
#include "../attention/block_sparse/unfused.hpp"
#include "../attention/bsb/plan.hpp"
#include "../formats/bsb_host.hpp"
#include "../layers/dense.hpp"
#include "../sparse/plan.hpp"
#include "device.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/formats/bsb.hpp"

namespace trisparse {
device_tensor::device_tensor(dtype, std::int64_t, std::int64_t, std::int64_t) {
  throw not_supported("device_tensor: this build has no CUDA backend");
}
device_tensor::device_tensor(const host_tensor&) {
  throw not_supported("device_tensor: this build has no CUDA backend");
}
device_tensor::~device_tensor() = default;
device_tensor::device_tensor(device_tensor&&) noexcept = default;
device_tensor& device_tensor::operator=(device_tensor&&) noexcept = default;
tensor_view device_tensor::view() const { return {}; }
host_tensor device_tensor::to_host() const { return {}; }
void device_tensor::fill_bytes(unsigned char) {}
void device_synchronize() {}
bsb build_bsb_cuda(const csr_graph&) {
  throw not_supported("build_bsb_cuda: this build has no CUDA backend");
}
}  // namespace trisparse

namespace trisparse::cuda {
int device_count() { return 0; }
std::string describe_device(int) { return ""; }

struct fused3s_device_plan {};
namespace {
[[noreturn]] void no_backend() {
  throw not_supported(
      "this build has no CUDA backend (configure with TRISPARSE_CUDA=ON where nvcc exists)");
}
}  // namespace
std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_graph&, fused3s_limits, stream_ref,
                                                       const std::vector<std::int64_t>&) {
  no_backend();
}
std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_view&, fused3s_limits,
                                                       stream_ref) {
  no_backend();
}
std::size_t fused3s_workspace_bytes(const fused3s_device_plan&, std::int64_t, std::int64_t) {
  return 0;
}
void run_fused3s(const fused3s_device_plan&, const tensor_view&, const tensor_view&,
                 const tensor_view&, const tensor_view&, double, const workspace_view*,
                 stream_ref) {
  throw not_supported("this build has no CUDA backend");
}
std::int64_t device_bytes(const fused3s_device_plan&) { return 0; }

struct me_device_plan {};
std::shared_ptr<me_device_plan> make_me_plan(const csr_graph&, int, me_work_limits, stream_ref,
                                             std::span<const std::int64_t>) {
  no_backend();
}
std::shared_ptr<me_device_plan> make_me_plan(const csr_view&, const float*, int, me_work_limits,
                                             stream_ref) {
  no_backend();
}
me_plan_info info(const me_device_plan&) { return {}; }
std::size_t me_workspace_bytes(const me_device_plan&, std::int64_t, std::int64_t) { return 0; }
void run_spmm(const me_device_plan&, const tensor_view&, const tensor_view&, const tensor_view&,
              const workspace_view*, stream_ref) {
  no_backend();
}
void run_sddmm(const me_device_plan&, const tensor_view&, const tensor_view&, const tensor_view&,
               double, bool, stream_ref) {
  no_backend();
}
void run_softmax(const me_device_plan&, const tensor_view&, const tensor_view&,
                 const workspace_view*, stream_ref) {
  no_backend();
}
void entries_to_slots(const me_device_plan&, const tensor_view&, const tensor_view&, stream_ref) {
  no_backend();
}
void slots_to_entries(const me_device_plan&, const tensor_view&, const tensor_view&, stream_ref) {
  no_backend();
}
}  // namespace trisparse::cuda

namespace trisparse::cuda {
void gemm(const tensor_view&, const tensor_view&, const tensor_view&, const workspace_view&,
          stream_ref) {
  no_backend();
}
void normalize_rows(const tensor_view&, const tensor_view&, stream_ref) { no_backend(); }
}  // namespace trisparse::cuda

namespace trisparse::cuda {
struct block_sparse_device_plan {};
bool block_sparse_supports(std::int64_t) { return false; }
std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan(const block_sparse_mask&,
                                                                 block_kernel, stream_ref) {
  no_backend();
}
const char* kernel_name(const block_sparse_device_plan&) { return ""; }
void run_block_sparse(const block_sparse_device_plan&, const tensor_view&, const tensor_view&,
                      const tensor_view&, const tensor_view&, double, stream_ref) {
  no_backend();
}
std::int64_t device_bytes(const block_sparse_device_plan&) { return 0; }
struct topk_device_plan {};
std::shared_ptr<topk_device_plan> make_topk_plan(const block_sparse_mask&, std::int64_t, bool,
                                                 std::int64_t, block_kernel, stream_ref) {
  no_backend();
}
const block_sparse_device_plan& attention_of(const topk_device_plan&) { no_backend(); }
void select_topk(topk_device_plan&, const tensor_view&, const tensor_view&, stream_ref) {
  no_backend();
}
std::vector<std::int32_t> download_blocks(const topk_device_plan&, stream_ref) { no_backend(); }
struct unfused_device_plan {};
std::shared_ptr<unfused_device_plan> make_unfused_plan(const block_sparse_mask&, std::int64_t,
                                                       stream_ref) {
  no_backend();
}
std::size_t unfused_workspace_bytes(const unfused_device_plan&, std::int64_t) { return 0; }
void run_unfused(const unfused_device_plan&, const tensor_view&, const tensor_view&,
                 const tensor_view&, const tensor_view&, double, const workspace_view*, stream_ref,
                 std::array<double, 3>*) {
  no_backend();
}
std::int64_t device_bytes(const unfused_device_plan&) { return 0; }
std::int64_t score_bytes_per_head(const unfused_device_plan&) { return 0; }
}  // namespace trisparse::cuda
