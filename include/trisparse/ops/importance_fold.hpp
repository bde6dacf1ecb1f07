#pragma once
/// @file A pattern learner's step (Python's PatternLearner) in calls on the inputs' device: its
/// schedule, the pooled estimate of every block's attention mass (what a mask's dropped blocks
/// are judged by), the fold of a backward's kernel-measured block mass into the learner's
/// moving average, and the pruning of the average to the blocks kept. On CUDA each is
/// stream-ordered kernels with no host synchronisation and no allocation (capturable in a CUDA
/// graph), and the last three take a `due` flag on the device: where it is false the kernels
/// return at once, so that a captured step does the work only at its cadence. The CPU runs the
/// same arithmetic in loops.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "trisparse/core/host_device.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse {

/// Bytes of the workspace pooled_block_mass takes for these sizes on CUDA (the block means, in
/// float64); the CPU takes none.
std::size_t pooled_block_mass_workspace_bytes(std::int64_t heads, std::int64_t n_q,
                                              std::int64_t n_k, std::int64_t dim,
                                              std::int64_t block);

/// The pooled estimate of each block's attention mass (the scores top-k block routing ranks by):
/// per head and block row r, the softmax over key blocks c of
///   scale <mean of r's q rows, mean of c's k rows> + log(keys in c),
/// causal blocks past the diagonal (aligned at the bottom right) excluded, into `out`
/// [H][ceil(N_q / G)][ceil(N_k / G)] float64, dense, on q's device; block rows that see no key
/// block hold zeros. q [N_q, H, D], k [N_k, H, D], any dtype, on one device; means, scores and
/// softmax in float64, each sum in a fixed order (the same bits on every run). scale <= 0:
/// 1/sqrt(D). On CUDA `workspace` holds pooled_block_mass_workspace_bytes on q's device and
/// the kernels run on `stream`. `due` (one flag on q's device, or null): out is written only
/// where it is true.
/// @throws invalid_input for mismatched shapes or devices, block < 1 or a short workspace.
void pooled_block_mass(const tensor_view& q, const tensor_view& k, std::int64_t block, bool causal,
                       double scale, double* out, void* workspace, std::size_t workspace_bytes,
                       stream_ref stream = {}, const bool* due = nullptr);

/// One observation of the kernels' block mass folded into an importance average.
struct importance_fold_args {
  double* state = nullptr;  ///< [heads][qb][kb] float64, dense: the average, updated in place
  /// [batch][heads][qb][kb] float32 at `mass_strides` (elements): each kept block's mass as the
  /// backward measured it (a block row's kept masses sum to 1), averaged over the batch.
  const float* mass = nullptr;
  std::int64_t mass_strides[4] = {0, 0, 0, 1};
  std::int64_t batch = 1;
  const bool* keep = nullptr;      ///< [heads][qb][kb], dense: the blocks the mask held
  const double* pooled = nullptr;  ///< [heads][qb][kb], dense: pooled_block_mass of that step
  const bool* seen = nullptr;      ///< [qb]: block rows observed before (nullptr: every row)
  const bool* due = nullptr;  ///< one flag on the state's device: fold only if true (null: always)
  std::int64_t heads = 0, qb = 0, kb = 0;
  double decay = 0.9;
  device_kind where = device_kind::cpu;
  int device_id = 0;
  /// @throws invalid_input naming the field that is out of range.
  void check() const;
};

/// Per head, block row r and key block c: the new importance is the pooled estimate where the
/// mask dropped the block, and where it kept it the block's measured mass times the pooled
/// estimate's total over the kept blocks of the row (the kept blocks' share split by what the
/// kernels saw); state = decay * state + (1 - decay) * new where row r was seen, else new.
/// Python's PatternLearner.observe_importance with aggregate "ema"; one kernel on CUDA.
/// @throws invalid_input as check() does.
void fold_block_importance(const importance_fold_args& args, stream_ref stream = {});

/// What a learner's step s does (advance_learner_schedule).
struct learner_flags {
  bool prune = false;  ///< re-prune (due at the end of step s - 1)
  bool fold = false;   ///< fold step s - 1's measured mass
  bool track = false;  ///< make step s's pooled estimate (the next step folds it)
};

/// A learner's schedule at step s (floor modulo; frozen at s >= freeze_after, never where < 0):
///   prune = (s - warmup - 1) % every == 0 and not frozen at s - 1,
///   fold = (s - 1) % track_every == 0 and not frozen at s,
///   track = s % track_every == 0 and not frozen at s + 1.
TRISPARSE_HOST_DEVICE learner_flags schedule_flags(std::int64_t s, std::int64_t warmup,
                                                   std::int64_t every, std::int64_t track_every,
                                                   std::int64_t freeze_after) {
  const auto hits = [](std::int64_t x, std::int64_t m) { return ((x % m) + m) % m == 0; };
  const auto live = [&](std::int64_t at) { return freeze_after < 0 || at < freeze_after; };
  return {hits(s - warmup - 1, every) && live(s - 1), hits(s - 1, track_every) && live(s),
          hits(s, track_every) && live(s + 1)};
}

/// A learner's schedule counted on the device (a captured step replays with no host in it).
struct learner_schedule_args {
  std::int64_t* steps = nullptr;  ///< the step count s, on the device: read, then s + 1
  bool* flags = nullptr;  ///< [3] on the same device: schedule_flags(s) as prune, fold, track
  std::int64_t warmup = 0, every = 1, track_every = 1;
  std::int64_t freeze_after = -1;  ///< < 0: never frozen
  device_kind where = device_kind::cpu;
  int device_id = 0;
  /// @throws invalid_input naming the field that is out of range.
  void check() const;
};

/// flags = schedule_flags(*steps, ...), then *steps += 1: one thread on CUDA (stream-ordered,
/// capturable), so that a replayed step knows what is due with no host in it.
/// @throws invalid_input as check() does.
void advance_learner_schedule(const learner_schedule_args& args, stream_ref stream = {});

/// What prune_block_importance ranks the blocks over.
enum class prune_scope : std::uint8_t {
  row,     ///< each (head, block row) keeps `budget` of its key blocks
  global,  ///< each head keeps `budget` of all its blocks
};

/// The blocks `sparsity` leaves of n: round((1 - sparsity) n), half to even, at least 1 (the
/// offline learner's, prune_block_importance's and Python's prune_blocks' budget).
inline std::int64_t prune_budget(double sparsity, std::int64_t n) {
  return std::max<std::int64_t>(1, std::llrint((1.0 - sparsity) * static_cast<double>(n)));
}

/// Bytes of the workspace prune_block_importance takes on CUDA for these sizes: a global prune
/// of heads of more than 16,384 blocks ranks each head over many thread blocks through per-head
/// digit counts (about 16 KiB a head); other prunes, and the CPU, take none.
std::size_t prune_block_importance_workspace_bytes(std::int64_t heads, std::int64_t qb,
                                                   std::int64_t kb, prune_scope scope);

/// One pruning of an importance average to the blocks kept.
struct block_prune_args {
  const double* importance = nullptr;  ///< [heads][qb][kb] float64, dense
  const bool* forced = nullptr;        ///< [qb][kb], dense, the same for every head (null: none)
  bool* keep = nullptr;                ///< [heads][qb][kb], dense: written only where due
  const bool* due = nullptr;  ///< one flag on keep's device: prune only if true (null: always)
  std::int64_t heads = 0, qb = 0, kb = 0;
  std::int64_t budget = 1;  ///< blocks kept per row or head, forced ones first (prune_budget)
  prune_scope scope = prune_scope::row;
  device_kind where = device_kind::cpu;
  int device_id = 0;
  /// On CUDA: prune_block_importance_workspace_bytes on keep's device (may be null where 0).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  /// @throws invalid_input naming the field that is out of range.
  void check() const;
};

/// keep = forced | the `budget` highest-ranked blocks of each row (or head), ranked by
/// importance with forced blocks first, ties to the lower index (row-major): a stable sort's
/// first `budget` (NaN ranks highest, -0 equals 0), as Python's prune_blocks "row" / "global".
/// On CUDA a radix select a row or head, one kernel (a long head's global prune: ten, over its
/// chunks, their digit counts summed in the workspace: integer sums, the same blocks on every
/// run); where `due` is false the kernels return at once and keep is untouched.
/// @throws invalid_input as check() does, or for a short workspace.
void prune_block_importance(const block_prune_args& args, stream_ref stream = {});

}  // namespace trisparse
