#pragma once
// A host model of how the fused 3S kernel's warps get through their work (plain C++, no CUDA
// headers), used to choose how windows are cut (the split limit) and which items run on teams.
//
// The kernel's time on graphs that do not fill the GPU is set by its schedule, not by bandwidth:
// the warp that ends last. The model replays the kernel's claiming order (team tasks on whole
// blocks first, then warp tasks largest first, each to the warp that frees up first) with a cost
// per item start, per TCB, per queue claim, per split part and per merge, calibrated on an H200
// by sweeping the split limit and the team rule over the shared datasets
// (docs/notes/fused3s.md; the sweeps are in bench/results at 0c8e661). Its
// absolute times are not the kernel's (the time per TCB varies between graphs); its order of the
// choices within one graph is what is used.
#include <cstdint>
#include <span>
#include <vector>

namespace trisparse::cuda::fused3s {

/// Microseconds: each task's start (descriptor, Q rows, first indices and rows), each TCB of a
/// warp's chain, a team's combine, a split part's partial write, the merge after a split window's
/// last part, and each claim from the queue.
struct schedule_costs {
  double start, per_tcb, combine, part, merge, claim;
};

/// The kernel's work items for windows of `window_tcbs` TCBs cut at `limit`, as build_work_list
/// cuts them: TCB counts in decreasing order (stable) and, per item, whether it is a part of a
/// split window (its index among the split windows, or -1).
struct item_list {
  std::vector<std::int32_t> tcbs, split;
  std::int32_t splits = 0;
};
item_list cut_windows(std::span<const std::int32_t> window_tcbs, std::int64_t limit);

/// How many items (the leading ones, items being in decreasing order) have at least `t` TCBs.
std::int64_t at_least(const item_list& items, std::int32_t t);

/// Predicted kernel time (µs, up to a per-graph factor) of `items` for `heads` heads on `blocks`
/// resident thread blocks of `warps` warps, the first `team_items` items on teams.
double predicted_time(const item_list& items, std::int64_t team_items, std::int64_t heads,
                      std::int64_t blocks, int warps);

/// How many of the largest items run on teams: the spare-slot rule below, unless no teams or
/// teams on every item of at least 8, 12, 16 or 24 TCBs is predicted at least 10% faster (the
/// fastest of those). Beyond two tasks per warp slot teams cannot shorten the kernel, and none
/// are chosen without replaying it.
std::int64_t choose_team_items(const item_list& items, std::int64_t heads, std::int64_t blocks,
                               int warps);

/// Teams only on warp slots that would idle otherwise: the largest items of at least 8 TCBs, as
/// many as keep every task running at once (a team takes `warps` slots for 1).
std::int64_t spare_slot_teams(const item_list& items, std::int64_t heads, std::int64_t blocks,
                              int warps);

/// The split limit. On large graphs (more than 12 TCBs per warp slot of 16 warps per SM) a few
/// times the mean work per slot, as swept before (bench/results at
/// 0c8e661), never below 24. Below, that limit unless a limit in 24..64 with its own team choice is
/// predicted at least 10% faster for one head at 2 blocks per SM (D = 128); the fastest such,
/// ties to the larger limit.
std::int64_t choose_split_limit(std::span<const std::int32_t> window_tcbs, int sms, int warps);

}  // namespace trisparse::cuda::fused3s
