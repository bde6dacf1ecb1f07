#include "schedule.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

namespace trisparse::cuda::fused3s {

namespace {

// Fitted to a sweep of the split limit (12-32) x the team rule on 11 shared datasets (H200, D =
// 128, one head, two blocks per SM; least squares on the log of each time against its graph's mean:
// 3.3% left), then checked on a sweep of 36, those 11 included (limits 16-64, 6.6% left):
// docs/notes/fused3s.md, "v10".
constexpr schedule_costs kCosts{
    .start = 2.9, .per_tcb = 0.365, .combine = 0.0, .part = 1.93, .merge = 2.82, .claim = 0.76};

// Tasks per warp slot beyond which teams are not considered: the kernel is then bound by its
// total work, which teams only add to.
constexpr std::int64_t kTeamRounds = 2;

// The smallest team item of each team rule tried (besides none and the spare-slot rule).
constexpr std::int32_t kTeamThresholds[] = {8, 12, 16, 24};

// A choice other than the rules measured before (the swept split limit, teams on spare slots)
// must be predicted this much faster: the model's error within one graph is about 6%.
constexpr double kMargin = 0.9;

// Split limits tried on graphs that do not fill the GPU many times over. Below 24 the model
// chose limits that measured up to 15% slower (merges cost more than it counts).
constexpr std::int64_t kLimits[] = {24, 28, 32, 40, 48, 64};

// One task's time on its warp(s): a team's members take 1/warps of the chain each.
double task_cost(std::int64_t tcbs, bool part, bool team, int warps) {
  const std::int64_t chain = team ? (tcbs + warps - 1) / warps : tcbs;
  return kCosts.start + kCosts.per_tcb * static_cast<double>(chain) +
         (team ? kCosts.combine : 0.0) + (part ? kCosts.part : 0.0);
}

// A time no schedule of these tasks beats: the longest task and the work per warp slot.
double lower_bound(const item_list& items, std::int64_t team_items, std::int64_t heads,
                   std::int64_t blocks, int warps) {
  double longest = 0.0, work = 0.0;
  for (std::size_t i = 0; i < items.tcbs.size(); ++i) {
    const bool team = static_cast<std::int64_t>(i) < team_items;
    const double t = task_cost(items.tcbs[i], items.split[i] >= 0, team, warps);
    longest = std::max(longest, t);
    work += t * static_cast<double>(team ? warps : 1);
  }
  return std::max(longest, work * static_cast<double>(heads) / static_cast<double>(blocks * warps));
}

}  // namespace

std::int64_t at_least(const item_list& items, std::int32_t t) {
  const auto end = std::partition_point(items.tcbs.begin(), items.tcbs.end(),
                                        [&](std::int32_t x) { return x >= t; });
  return end - items.tcbs.begin();
}

item_list cut_windows(std::span<const std::int32_t> window_tcbs, std::int64_t limit) {
  item_list out;
  out.tcbs.reserve(window_tcbs.size());
  out.split.reserve(window_tcbs.size());
  for (const std::int32_t n : window_tcbs) {
    if (n <= limit) {
      out.tcbs.push_back(n);
      out.split.push_back(-1);
      continue;
    }
    const std::int64_t parts = (n + limit - 1) / limit;
    for (std::int64_t i = 0; i < parts; ++i) {
      out.tcbs.push_back(static_cast<std::int32_t>(n * (i + 1) / parts - n * i / parts));
      out.split.push_back(out.splits);
    }
    ++out.splits;
  }
  // Decreasing TCB counts, stable (windows in order, a window's parts in order): a counting sort.
  const std::int32_t most =
      out.tcbs.empty() ? 0 : *std::max_element(out.tcbs.begin(), out.tcbs.end());
  std::vector<std::size_t> at(static_cast<std::size_t>(most) + 2, 0);
  for (const std::int32_t n : out.tcbs) ++at[static_cast<std::size_t>(most - n) + 1];
  std::partial_sum(at.begin(), at.end(), at.begin());
  item_list sorted{.tcbs = std::vector<std::int32_t>(out.tcbs.size()),
                   .split = std::vector<std::int32_t>(out.tcbs.size()),
                   .splits = out.splits};
  for (std::size_t i = 0; i < out.tcbs.size(); ++i) {
    const std::size_t to = at[static_cast<std::size_t>(most - out.tcbs[i])]++;
    sorted.tcbs[to] = out.tcbs[i];
    sorted.split[to] = out.split[i];
  }
  return sorted;
}

double predicted_time(const item_list& items, std::int64_t team_items, std::int64_t heads,
                      std::int64_t blocks, int warps) {
  const auto& c = kCosts;
  const std::int64_t tasks = static_cast<std::int64_t>(items.tcbs.size()) * heads;
  const std::int64_t team_tasks = team_items * heads;
  if (tasks == 0) return 0.0;
  const auto cost = [&](std::int64_t task) {
    const auto i = static_cast<std::size_t>(task / heads);
    return task_cost(items.tcbs[i], items.split[i] >= 0, task < team_tasks, warps);
  };
  // As the launch sizes the grid: a block per team task and a warp per other task if that fits.
  const std::int64_t one_each = team_tasks + (tasks - team_tasks + warps - 1) / warps;
  const std::int64_t grid = std::min(one_each, blocks);
  // The end, and the last part's end of each split window (its merge runs after it).
  double end = 0.0;
  std::vector<double> last(static_cast<std::size_t>(items.splits) * heads, 0.0);
  const auto finish = [&](std::int64_t task, double at) {
    end = std::max(end, at);
    const std::int32_t s = items.split[static_cast<std::size_t>(task / heads)];
    if (s >= 0) {
      double& l = last[static_cast<std::size_t>(s * heads + task % heads)];
      l = std::max(l, at);
    }
  };
  if (one_each <= grid) {
    for (std::int64_t t = 0; t < tasks; ++t) finish(t, cost(t));
  } else {
    // Team tasks on whole blocks: block b takes task b first, then claims the next.
    std::vector<double> team_blocks(static_cast<std::size_t>(std::min(team_tasks, grid)), 0.0);
    for (std::int64_t t = 0; t < team_tasks; ++t) {
      std::pop_heap(team_blocks.begin(), team_blocks.end(), std::greater<>{});
      double& free = team_blocks.back();
      free += (t >= grid ? c.claim : 0.0) + cost(t);
      finish(t, free);
      std::push_heap(team_blocks.begin(), team_blocks.end(), std::greater<>{});
    }
    // Then warp tasks, each to the warp that can start one first (a claim included). Without teams
    // a warp's first task is its index; with teams every warp task is claimed (blocks leave the
    // team phase at different times), and a warp leaving a team first fails to claim a team task.
    // The warps' first turns in order (the other blocks' warps, then those leaving teams, which
    // claim twice), taken while none is later than a warp that is done; then a min-heap of all of
    // them. Most tasks take no heap operation.
    std::vector<double> ready(static_cast<std::size_t>((grid - std::ssize(team_blocks)) * warps),
                              team_tasks > 0 ? c.claim : 0.0);
    std::sort_heap(team_blocks.begin(), team_blocks.end(), std::greater<>{});
    for (auto b = team_blocks.rbegin(); b != team_blocks.rend(); ++b)
      ready.insert(ready.end(), warps, *b + 2 * c.claim);
    std::vector<double> busy;
    busy.reserve(ready.size());
    std::size_t next = 0;
    double soonest = std::numeric_limits<double>::infinity();
    std::int64_t t = team_tasks;
    for (; t < tasks && next < ready.size() && ready[next] <= soonest; ++t) {
      const double at = ready[next++] + cost(t);
      finish(t, at);
      busy.push_back(at + c.claim);
      soonest = std::min(soonest, busy.back());
    }
    busy.insert(busy.end(), ready.begin() + static_cast<std::ptrdiff_t>(next), ready.end());
    std::make_heap(busy.begin(), busy.end(), std::greater<>{});
    for (; t < tasks; ++t) {
      std::pop_heap(busy.begin(), busy.end(), std::greater<>{});
      double& at = busy.back();
      at += cost(t);
      finish(t, at);
      at += c.claim;
      std::push_heap(busy.begin(), busy.end(), std::greater<>{});
    }
  }
  for (const double l : last) end = std::max(end, l + c.merge);
  return end;
}

std::int64_t spare_slot_teams(const item_list& items, std::int64_t heads, std::int64_t blocks,
                              int warps) {
  if (heads <= 0) return 0;
  const std::int64_t spare =
      blocks * warps - static_cast<std::int64_t>(items.tcbs.size()) * heads - (warps - 1);
  return std::clamp<std::int64_t>(spare / ((warps - 1) * heads), 0, at_least(items, 8));
}

std::int64_t choose_team_items(const item_list& items, std::int64_t heads, std::int64_t blocks,
                               int warps) {
  const std::int64_t tasks = static_cast<std::int64_t>(items.tcbs.size()) * heads;
  if (heads <= 0 || tasks > kTeamRounds * blocks * warps) return 0;
  const std::int64_t rule = spare_slot_teams(items, heads, blocks, warps);
  std::int64_t best = rule;
  double best_time = predicted_time(items, rule, heads, blocks, warps);
  const double bar = kMargin * best_time;
  std::vector<std::int64_t> options{0};
  for (const std::int32_t t : kTeamThresholds) options.push_back(at_least(items, t));
  std::sort(options.begin(), options.end());
  options.erase(std::unique(options.begin(), options.end()), options.end());
  for (const std::int64_t teams : options) {
    if (teams == rule ||
        lower_bound(items, teams, heads, blocks, warps) >= std::min(bar, best_time))
      continue;
    const double t = predicted_time(items, teams, heads, blocks, warps);
    if (t < bar && t < best_time) {
      best = teams;
      best_time = t;
    }
  }
  return best;
}

std::int64_t choose_split_limit(std::span<const std::int32_t> window_tcbs, int sms, int warps) {
  const std::int64_t tcbs =
      std::accumulate(window_tcbs.begin(), window_tcbs.end(), std::int64_t{0});
  const std::int64_t slots = std::int64_t{sms} * 16;
  const std::int64_t mean = (tcbs + slots - 1) / slots;
  const std::int64_t swept = std::max<std::int64_t>(24, std::min(3 * mean, 2 * mean + 8));
  if (window_tcbs.empty() || swept > kLimits[std::size(kLimits) - 1] / 2) return swept;
  const std::int64_t blocks = std::int64_t{sms} * 2;
  // Limits of at least the longest window all leave every window whole: one replay for them.
  const std::int64_t longest = *std::max_element(window_tcbs.begin(), window_tcbs.end());
  const auto time_at = [&](std::int64_t limit, double skip_from) {
    const item_list items = cut_windows(window_tcbs, limit);
    // No team choice does better than its bound: skip limits that cannot win.
    double bound = lower_bound(items, 0, 1, blocks, warps);
    for (const std::int32_t t : kTeamThresholds)
      bound = std::min(bound, lower_bound(items, at_least(items, t), 1, blocks, warps));
    if (bound >= skip_from) return bound;
    return predicted_time(items, choose_team_items(items, 1, blocks, warps), 1, blocks, warps);
  };
  std::int64_t best = swept;
  double best_time = time_at(swept, std::numeric_limits<double>::infinity());
  const double bar = kMargin * best_time;
  bool whole_tried = swept >= longest;
  for (const std::int64_t limit : kLimits) {
    if (limit == swept || (limit >= longest && whole_tried)) continue;
    whole_tried = whole_tried || limit >= longest;
    const double t = time_at(limit, bar);
    if (t < bar && t <= best_time) {
      best = limit;
      best_time = t;
    }
  }
  return best;
}

}  // namespace trisparse::cuda::fused3s
