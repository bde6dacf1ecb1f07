// The host model of the fused 3S kernel's schedule (an internal helper; the kernel runs on the
// GPU): windows cut as the device work list cuts them, the replayed time following the chains it
// models, and the choices it makes where the answer is known.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "../../src/cuda/attention/fused3s/schedule.hpp"

namespace trisparse {
namespace {

namespace fs = cuda::fused3s;

std::vector<std::int32_t> random_windows(std::size_t n, std::int32_t most, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> d(0, most);
  std::vector<std::int32_t> w(n);
  for (auto& x : w) x = d(rng);
  return w;
}

TEST(Fused3sSchedule, CutsWindowsAsTheWorkList) {
  for (const std::int64_t limit : {1, 7, 24, 64}) {
    const auto windows = random_windows(500, 150, static_cast<unsigned>(limit));
    const fs::item_list items = fs::cut_windows(windows, limit);
    ASSERT_EQ(items.tcbs.size(), items.split.size());
    EXPECT_TRUE(std::is_sorted(items.tcbs.rbegin(), items.tcbs.rend()));
    EXPECT_EQ(std::accumulate(items.tcbs.begin(), items.tcbs.end(), std::int64_t{0}),
              std::accumulate(windows.begin(), windows.end(), std::int64_t{0}));
    std::size_t expected_items = 0;
    std::int32_t expected_splits = 0;
    for (const std::int32_t n : windows) {
      const std::int64_t parts = n > limit ? (n + limit - 1) / limit : 1;
      expected_items += static_cast<std::size_t>(parts);
      expected_splits += parts > 1;
    }
    EXPECT_EQ(items.tcbs.size(), expected_items);
    EXPECT_EQ(items.splits, expected_splits);
    // Every item fits the limit; the parts of one window differ by at most one TCB.
    std::vector<std::int32_t> low(static_cast<std::size_t>(items.splits), 1 << 30),
        high(low.size(), 0);
    for (std::size_t i = 0; i < items.tcbs.size(); ++i) {
      EXPECT_LE(items.tcbs[i], limit);
      if (items.split[i] < 0) continue;
      ASSERT_LT(items.split[i], items.splits);
      const auto s = static_cast<std::size_t>(items.split[i]);
      low[s] = std::min(low[s], items.tcbs[i]);
      high[s] = std::max(high[s], items.tcbs[i]);
    }
    for (std::size_t s = 0; s < low.size(); ++s) EXPECT_LE(high[s] - low[s], 1);
  }
}

TEST(Fused3sSchedule, TimeFollowsTheLongestChain) {
  // Everything runs at once (fewer tasks than warps): the time is the longest item's chain.
  const std::vector<std::int32_t> windows{20, 3, 3, 3, 1};
  const fs::item_list items = fs::cut_windows(windows, 64);
  const fs::item_list longest = fs::cut_windows(std::vector<std::int32_t>{20}, 64);
  const fs::item_list shorter = fs::cut_windows(std::vector<std::int32_t>{19}, 64);
  EXPECT_DOUBLE_EQ(fs::predicted_time(items, 0, 1, 8, 4), fs::predicted_time(longest, 0, 1, 8, 4));
  EXPECT_GT(fs::predicted_time(longest, 0, 1, 8, 4), fs::predicted_time(shorter, 0, 1, 8, 4));
  // A team shares the chain among its warps.
  EXPECT_LT(fs::predicted_time(items, 1, 1, 8, 4), fs::predicted_time(items, 0, 1, 8, 4));
  // More heads than warps: the work queues up and takes longer.
  EXPECT_GT(fs::predicted_time(items, 0, 64, 8, 4), fs::predicted_time(items, 0, 1, 8, 4));
  // A split window pays its merge after its last part.
  const fs::item_list cut = fs::cut_windows(std::vector<std::int32_t>{40}, 20);
  EXPECT_GT(fs::predicted_time(cut, 0, 1, 8, 4),
            fs::predicted_time(fs::cut_windows(std::vector<std::int32_t>{20}, 64), 0, 1, 8, 4));
  EXPECT_EQ(fs::predicted_time(fs::cut_windows(std::vector<std::int32_t>{}, 8), 0, 1, 8, 4), 0.0);
}

TEST(Fused3sSchedule, TeamsWhereOneChainIsLongAndNotWhereTheGpuIsFull) {
  // One long window among short ones on an idle GPU: its chain decides, so it gets a team.
  std::vector<std::int32_t> windows(100, 2);
  windows.push_back(60);
  const fs::item_list lone = fs::cut_windows(windows, 64);
  const std::int64_t teams = fs::choose_team_items(lone, 1, 264, 4);
  EXPECT_GE(teams, 1);
  EXPECT_LT(fs::predicted_time(lone, teams, 1, 264, 4), fs::predicted_time(lone, 0, 1, 264, 4));
  // Equal windows, far more tasks than warps: teams only add work.
  const fs::item_list full = fs::cut_windows(std::vector<std::int32_t>(20000, 12), 64);
  EXPECT_EQ(fs::choose_team_items(full, 1, 264, 4), 0);
  EXPECT_EQ(fs::choose_team_items(full, 8, 264, 4), 0);
  // The spare-slot rule gives teams only while every task still runs at once.
  for (const std::int64_t blocks : {26, 30, 264}) {
    for (const std::int64_t heads : {1, 2, 8}) {
      const std::int64_t t = fs::spare_slot_teams(lone, heads, blocks, 4);
      const auto tasks = static_cast<std::int64_t>(lone.tcbs.size()) * heads;
      if (t > 0) {
        EXPECT_LE(t * heads * 4 + (tasks - t * heads), blocks * 4);
      }
      if (tasks + 3 * heads + 3 <= blocks * 4) {
        EXPECT_EQ(t, 1) << blocks << " " << heads;
      }
    }
  }
}

TEST(Fused3sSchedule, SplitLimit) {
  // Large graphs keep the swept rule: a few times the mean TCBs per warp slot (16 per SM).
  const std::vector<std::int32_t> large(100000, 30);  // 3M TCBs, mean 1,421 per slot on 132 SMs
  const std::int64_t mean = (3000000 + 132 * 16 - 1) / (132 * 16);
  EXPECT_EQ(fs::choose_split_limit(large, 132, 4), std::min(3 * mean, 2 * mean + 8));
  // An idle GPU with one long window: a team shortens it without a merge, so it is not cut.
  std::vector<std::int32_t> small(300, 6);
  small.push_back(30);
  const std::int64_t limit = fs::choose_split_limit(small, 132, 4);
  EXPECT_GE(limit, 30);
  EXPECT_LE(limit, 64);
  const auto windows = random_windows(1000, 40, 3);
  const std::int64_t l = fs::choose_split_limit(windows, 132, 4);
  EXPECT_TRUE(l == 24 || l == 28 || l == 32 || l == 40 || l == 48 || l == 64) << l;
}

}  // namespace
}  // namespace trisparse
