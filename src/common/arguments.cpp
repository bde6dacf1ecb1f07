#include "arguments.hpp"

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "trisparse/core/error.hpp"

namespace trisparse::detail {

void check_attention_args(std::int64_t rows, std::int64_t cols, const tensor_view& q,
                          const tensor_view& k, const tensor_view& v, const tensor_view& out,
                          device_kind where) {
  check_view(q, "q", rows, -1, -1);
  check_view(k, "k", cols, q.heads, q.dim);
  check_view(v, "v", cols, q.heads, -1);
  check_view(out, "out", rows, q.heads, v.dim);
  for (const auto* t : {&q, &k, &v, &out}) {
    if (t->where != where) {
      throw invalid_input(std::string(t == &q   ? "q"
                                      : t == &k ? "k"
                                      : t == &v ? "v"
                                                : "out") +
                          " is on " + to_string(t->where) + " but the plan runs on " +
                          to_string(where));
    }
  }
}

void check_gradient_args(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                         const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                         device_kind where) {
  for (const auto& [t, like, what] :
       {std::tuple{&dq, &q, "dq"}, std::tuple{&dk, &k, "dk"}, std::tuple{&dv, &v, "dv"}}) {
    check_view(*t, what, like->rows, like->heads, like->dim);
    TRISPARSE_EXPECTS_INPUT(
        t->where == where, std::string(what) + " must be on " + to_string(where) + ", as the plan");
  }
}

void check_saved_forward(std::int64_t rows, const tensor_view& q, const tensor_view& v,
                         const tensor_view& out, const tensor_view& lse) {
  check_view(out, "out", rows, q.heads, v.dim);
  TRISPARSE_EXPECTS_INPUT(lse.data != nullptr,
                          "block-sparse backward needs the forward's lse (attention_options::lse)");
  check_view(lse, "lse", rows, q.heads, 1);
  for (const auto& [t, what] : {std::pair{&out, "out"}, std::pair{&lse, "lse"}}) {
    TRISPARSE_EXPECTS_INPUT(t->where == device_kind::cuda,
                            std::string(what) + " must be on the GPU");
  }
}

void check_bias(const tensor_view& bias, const char* what, std::int64_t nnz, std::int64_t heads,
                device_kind where, bool per_head) {
  TRISPARSE_EXPECTS_INPUT(where == device_kind::cpu || bias.type == dtype::f32,
                          std::string(what) + " must be f32 on CUDA, got " + bias.describe());
  const std::int64_t h = bias.heads == 1 && !per_head ? 1 : heads;
  check_view(bias, what, nnz, h, 1);
  TRISPARSE_EXPECTS_INPUT(bias.where == where, std::string(what) + " is on " +
                                                   to_string(bias.where) +
                                                   " but the plan runs on " + to_string(where));
}

void check_block_importance(const attention_options& options, std::int64_t batch, std::int64_t qb,
                            std::int64_t heads, std::int64_t kb, device_kind where) {
  for (const auto& [t, what] : {std::pair{&options.block_mass, "block_mass"},
                                std::pair{&options.block_grad, "block_grad"}}) {
    if (t->data == nullptr) continue;
    TRISPARSE_EXPECTS_INPUT(
        t->type == dtype::f32 || (where == device_kind::cpu && t->type == dtype::f64),
        std::string(what) + " must be f32" + (where == device_kind::cpu ? " or f64" : "") +
            ", got " + t->describe());
    check_view(*t, what, batch * qb, heads, kb);
    TRISPARSE_EXPECTS_INPUT(t->where == where, std::string(what) + " is on " + to_string(t->where) +
                                                   " but the plan runs on " + to_string(where));
  }
}

void check_block_bias(const attention_options& options, std::int64_t batch, std::int64_t qb,
                      std::int64_t heads, std::int64_t kb, device_kind where, bool backward) {
  TRISPARSE_EXPECTS_INPUT(backward || options.dblock_bias.data == nullptr,
                          "dblock_bias is written by backward(), not by this call");
  TRISPARSE_EXPECTS_INPUT(options.dblock_bias.data == nullptr || options.block_bias.data != nullptr,
                          "dblock_bias needs the block_bias the forward ran with");
  for (const auto& [t, what] : {std::pair{&options.block_bias, "block_bias"},
                                std::pair{&options.dblock_bias, "dblock_bias"}}) {
    if (t->data == nullptr) continue;
    TRISPARSE_EXPECTS_INPUT(
        t->type == dtype::f32 || (where == device_kind::cpu && t->type == dtype::f64),
        std::string(what) + " must be f32" + (where == device_kind::cpu ? " or f64" : "") +
            ", got " + t->describe());
    const bool shared = t == &options.block_bias && t->heads == 1;
    check_view(*t, what, batch * qb, shared ? 1 : heads, kb);
    TRISPARSE_EXPECTS_INPUT(t->where == where, std::string(what) + " is on " + to_string(t->where) +
                                                   " but the plan runs on " + to_string(where));
  }
}

void check_no_block_bias(const attention_options& options, const char* what) {
  if (options.block_bias.data == nullptr && options.dblock_bias.data == nullptr) return;
  throw not_supported(std::string(what) +
                      " takes no block bias (block-sparse plans over a given mask do)");
}

double resolve_scale(const std::optional<double>& scale, std::int64_t head_dim) {
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
  if (!std::isfinite(s)) throw invalid_input("scale must be finite, got " + std::to_string(s));
  return s;
}

void check_device_entries(std::int64_t nnz, const char* what) {
  TRISPARSE_EXPECTS_INPUT(
      nnz <= kMaxDeviceEntries,
      std::string(what) +
          " on CUDA takes patterns of at most 2^31 - 1 = " + std::to_string(kMaxDeviceEntries) +
          " entries (the limit its device formats and kernels are built and tested for); this "
          "one has " +
          std::to_string(nnz) + ": split the graph (trisparse.distributed) or run on the CPU");
}

void check_dropout(const attention_dropout& dropout) {
  TRISPARSE_EXPECTS_INPUT(
      dropout.p >= 0 && dropout.p < 1,
      "attention dropout: p must be in [0, 1), got " + std::to_string(dropout.p));
  TRISPARSE_EXPECTS_INPUT(dropout.p == 0 || dropout.state != nullptr,
                          "attention dropout: p > 0 needs the generator's state ({seed, offset} on "
                          "the device)");
}

void check_keep_or_dropout(const tensor_view& keep, const attention_dropout& dropout) {
  check_dropout(dropout);
  TRISPARSE_EXPECTS_INPUT(keep.data == nullptr || dropout.p == 0,
                          "attention dropout: give keep factors or dropout draws, not both");
}

void check_no_dropout(const attention_options& options, const char* what) {
  if (options.dropout.p == 0) return;
  throw not_supported(std::string(what) +
                      " does not draw attention dropout inside its kernels (attention within "
                      "segments, block-sparse and top-k plans do); drop the weights outside, or "
                      "give p = 0");
}

}  // namespace trisparse::detail
