// The host model behind the CUDA graph kernels' task order (an internal helper; the kernels run
// on the GPU): the reuse distances of a pattern's windows, in the order the windows run, and the
// choice of running the heads one after the other where gathers scatter.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "../../src/cuda/common/gather_reuse.hpp"
#include "support.hpp"

namespace trisparse {
namespace {

constexpr std::int64_t kL2 = 50 << 20;  // an H100's or H200's L2

std::int64_t total(const cuda::gather_reuse& r) {
  return std::accumulate(r.by_distance.begin(), r.by_distance.end(), std::int64_t{0});
}

TEST(GatherReuse, CountsTheWindowsBetweenGathersOfAColumn) {
  // 64 rows, 4 windows. Column 0: rows 0 and 3 (window 0, one gather), 17 (window 1) and 40
  // (window 2); column 5: row 63 only (window 3).
  const csr_graph g = to_csr(coo_graph{
      .rows = 64, .cols = 8, .src = {0, 3, 17, 40, 63}, .dst = {0, 0, 0, 0, 5}, .values = {}});
  const cuda::gather_reuse own = cuda::gather_reuse_of(g, {});
  EXPECT_EQ(own.windows, 4);
  EXPECT_EQ(own.gathers, 4);
  EXPECT_EQ(own.by_distance[0], 2);  // distances 1 and 1: bin 0 (octave 0)
  EXPECT_EQ(total(own), 2);
  // Windows 1 and 3 swapped: column 0 in windows 0, 3 (row 17) and 2 (row 40), in run order 0, 2,
  // 3: distances 2 (bin 4: octave 1, first quarter) and 1.
  std::vector<std::int64_t> order(64);
  for (std::int64_t i = 0; i < 64; ++i) {
    const std::int64_t w = i / 16, swapped = w == 1 ? 3 : w == 3 ? 1 : w;
    order[static_cast<std::size_t>(i)] = swapped * 16 + i % 16;
  }
  const cuda::gather_reuse swapped = cuda::gather_reuse_of(g, order);
  EXPECT_EQ(swapped.gathers, 4);
  EXPECT_EQ(swapped.by_distance[0], 1);
  EXPECT_EQ(swapped.by_distance[4], 1);
  EXPECT_EQ(total(swapped), 2);
  // A distance of 3 lies in octave 1's third quarter (bin 6), 12 in octave 3's third (bin 14).
  const csr_graph far = to_csr(coo_graph{
      .rows = 16 * 16, .cols = 2, .src = {0, 48, 16 * 15}, .dst = {1, 1, 1}, .values = {}});
  const cuda::gather_reuse r = cuda::gather_reuse_of(far, {});
  EXPECT_EQ(r.by_distance[6], 1);
  EXPECT_EQ(r.by_distance[14], 1);
}

TEST(GatherReuse, HeadsRunOneAfterTheOtherWhereGathersScatter) {
  // A band whose rows are shuffled: each column's gathers spread over the whole pass, and 8 heads'
  // K and V rows (40K x 8 x 256 bytes) outgrow the L2; one head's fit. In RCM order the band's
  // gathers are neighbours: nothing to save.
  const csr_graph band = test::shuffled_band(40000, 4, 7);
  cuda::gather_reuse scattered = cuda::gather_reuse_of(band, {});
  const double saving = cuda::heads_outer_saving(scattered, 8, 64, 2, kL2);
  EXPECT_GT(saving, cuda::kHeadsOuterSaving);
  EXPECT_LE(saving, 1.0);
  EXPECT_EQ(cuda::heads_outer_saving(scattered, 1, 64, 2, kL2), 0.0);
  EXPECT_FALSE(cuda::heads_outer(head_order::automatic, scattered, 8, 64)) << "not settled yet";
  cuda::settle_head_orders(scattered, kL2);
  EXPECT_TRUE(cuda::heads_outer(head_order::automatic, scattered, 8, 64));
  // The fewest heads that save enough, per head dim: the saving grows with the heads.
  for (std::size_t i = 0; i < scattered.min_heads.size(); ++i) {
    const std::int64_t dim = std::int64_t{32} << i, least = scattered.min_heads[i];
    ASSERT_GT(least, 1) << "dim " << dim;
    EXPECT_GE(cuda::heads_outer_saving(scattered, least, dim, 2, kL2), cuda::kHeadsOuterSaving);
    EXPECT_LT(cuda::heads_outer_saving(scattered, least - 1, dim, 2, kL2), cuda::kHeadsOuterSaving);
    EXPECT_FALSE(cuda::heads_outer(head_order::automatic, scattered, least - 1, dim));
    EXPECT_TRUE(cuda::heads_outer(head_order::automatic, scattered, least, dim));
  }
  EXPECT_FALSE(cuda::heads_outer(head_order::automatic, scattered, 8, 48)) << "no such kernel";
  cuda::gather_reuse local = cuda::gather_reuse_of(band, reverse_cuthill_mckee(band));
  EXPECT_LT(cuda::heads_outer_saving(local, 8, 64, 2, kL2), 0.01);
  cuda::settle_head_orders(local, kL2);
  EXPECT_FALSE(cuda::heads_outer(head_order::automatic, local, 8, 64));
  // Every head's rows within the L2 (4K nodes), or a larger L2: nothing to save.
  cuda::gather_reuse small = cuda::gather_reuse_of(test::shuffled_band(4000, 4, 8), {});
  cuda::settle_head_orders(small, kL2);
  EXPECT_FALSE(cuda::heads_outer(head_order::automatic, small, 8, 64));
  EXPECT_LT(cuda::heads_outer_saving(scattered, 8, 64, 2, 1024 * kL2), 0.01);
  // Asked for: as asked (with several heads); no statistics (a device pattern's plan): by window.
  EXPECT_TRUE(cuda::heads_outer(head_order::by_head, local, 8, 64));
  EXPECT_FALSE(cuda::heads_outer(head_order::by_head, local, 1, 64));
  EXPECT_FALSE(cuda::heads_outer(head_order::by_window, scattered, 8, 64));
  EXPECT_FALSE(cuda::heads_outer(head_order::automatic, cuda::gather_reuse{}, 8, 64));
}

TEST(GatherReuse, HeadOrdersByName) {
  for (const head_order o : {head_order::automatic, head_order::by_window, head_order::by_head})
    EXPECT_EQ(parse_head_order(to_string(o)), o);
  EXPECT_EQ(parse_head_order("auto"), head_order::automatic);
  EXPECT_THROW(parse_head_order("by_row"), invalid_input);
}

}  // namespace
}  // namespace trisparse
