// GPU tests (label gpu): skip cleanly where no device is visible.
#include "support.hpp"

namespace trisparse {
namespace {

TEST(Gpu, CudaPlansAreRefusedUntilTheKernelsExist) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping";
  const csr_graph g = test::random_pattern(64, 64, 4, 1);
  EXPECT_THROW(attention_plan::build(g, device_kind::cuda), not_supported);
}

}  // namespace
}  // namespace trisparse
