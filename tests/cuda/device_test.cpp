// GPU tests (label gpu): skip cleanly where no device is visible.
#include "support.hpp"

namespace trisparse {
namespace {

TEST(Gpu, PlansRunOnTheDeviceOrSayWhyNot) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping";
  const csr_graph g = test::random_pattern(64, 64, 4, 1);
  const attention_plan plan = attention_plan::build(g, device_kind::cuda);
  EXPECT_EQ(plan.report().algo, algorithm::fused);
  EXPECT_GT(plan.report().format_bytes, 0);
  const attention_plan unfused =
      attention_plan::build(g, device_kind::cuda, {.algo = algorithm::unfused});
  EXPECT_EQ(unfused.report().algo, algorithm::unfused);
  EXPECT_GT(unfused.report().format_bytes, 0);
  EXPECT_THROW(attention_plan::build(g, device_kind::cuda, {.algo = algorithm::blocked_reference}),
               invalid_input);
}

}  // namespace
}  // namespace trisparse
