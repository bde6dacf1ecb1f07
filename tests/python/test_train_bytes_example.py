"""examples/python/train_bytes.py (the learned-pattern plan's evaluation (b)) on the CPU at toy
sizes: every mode runs and writes the rows the docs cite."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "examples" / "python" / "train_bytes.py"
TOY = ["--steps", "3", "--seq", "256", "--sparsity", "0.5", "--learner-warmup", "1"]


def _rows(*args, ok=True):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *TOY, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if not ok:
        return run
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()][1:]  # past the corpus


def test_error_table_rows():
    (head, row) = _rows(
        "--mode",
        "errors",
        "--learn-samples",
        "1",
        "--gate-steps",
        "2",
        "--gate-probes",
        "4x2",
        "--gate-rank-weight",
        "0",
        "0.5",
    )
    assert head["steps"] == 3 and math.isfinite(head["bits_per_byte_dense"])
    assert row["sparsity"] == 0.5 and head["gate_probes"] == [[4, 2]]
    assert head["gate_schedule"] == "cosine" and not head["cuda_graph"]
    assert head["gate_rank_weight"] == [0.0, 0.5]
    columns = ("random", "local_strided", "topk", "learned", "gate", "gate_p4x2", "gate_p4x2_r0.5")
    columns = (*columns, "output")
    for column in (*columns, "oracle"):
        assert 0.0 <= row[column] < 1.5, (column, row[column])
    assert 0.0 < row["oracle_mass_kept"] <= 1.0


def test_error_table_from_saved_weights(tmp_path):
    """--save-model's weights (bf16) give --load-model the same model: the held-out bits per byte
    within bf16's rounding of the weights, and the table without training."""
    prefix, errors = str(tmp_path / "model"), ["--mode", "errors", "--learn-samples", "1"]
    (trained, row) = _rows(*errors, "--gate-steps", "2", "--save-model", prefix)
    assert (tmp_path / "model.0.pt").exists()
    (loaded, again) = _rows(*errors, "--gate-steps", "2", "--load-model", prefix)
    assert loaded["loaded_from"] == prefix and trained["loaded_from"] is None
    assert abs(loaded["bits_per_byte_dense"] - trained["bits_per_byte_dense"]) < 0.05
    assert again["oracle_mass_kept"] == pytest.approx(row["oracle_mass_kept"], abs=0.02)
    run = _rows(*errors, "--load-model", str(tmp_path / "absent"), ok=False)
    assert run.returncode != 0 and "absent.0.pt" in run.stderr


@pytest.mark.parametrize("learner", ["pattern", "gate"])
def test_train_rows(learner):
    probes = ["--gate-probes", "2x4"] if learner == "gate" else []
    dense, learned = _rows("--mode", "train", "--learner", learner, "--learner-every", "1", *probes)
    assert dense["mode"] == "dense" and learned["mode"] == "learned"
    assert learned["learner"] == learner and learned["sparsity"] == 0.5
    assert learner == "pattern" or learned["gate_probes"] == [2, 4]
    for row in (dense, learned):  # 3 steps from uniform bytes (8 bits): a little learned
        assert 0.0 < row["bits_per_byte"] < 8.0 and row["step_ms"] is None  # (CPU: not timed)
    (only,) = _rows("--mode", "train", "--skip-dense", "--track-every", "1")
    assert only["mode"] == "learned" and only["track_every"] == 1


def test_cost_mode_needs_cuda():
    run = _rows("--mode", "cost", ok=False)
    assert run.returncode != 0 and "--device cuda" in run.stderr


def test_cuda_graph_needs_cuda_and_the_pattern_learner():
    run = _rows("--mode", "train", "--cuda-graph", ok=False)
    assert run.returncode != 0 and "--cuda-graph" in run.stderr


@pytest.mark.gpu
def test_cuda_graph_rows():
    """--cuda-graph on the GPU: training replayed from a CUDA graph (capturable PatternLearners
    re-pruning inside it) and --mode cost's two graphs give finite rows; the learners counted
    every replayed step on the device."""
    graph = ["--device", "cuda", "--bf16", "--cuda-graph", "--channels", "128", "--heads", "2"]
    graph += ["--learner-warmup", "2", "--learner-every", "2"]
    steps = ["--steps", "14", "--seq", "1024"]
    dense, learned = _rows("--mode", "train", *graph, *steps)
    for row in (dense, learned):
        assert row["cuda_graph"] and 0.0 < row["bits_per_byte"] < 8.0 and row["step_ms"] > 0
    (cost,) = _rows("--mode", "cost", *graph, *steps, "--cost-period", "3", "--cost-rounds", "2")
    assert cost["cuda_graph"] and cost["tracked_ms"] > 0 and cost["untracked_ms"] > 0
    assert cost["tracked_kernel_ms"] > cost["untracked_kernel_ms"] > 0
    # 14 training steps, then the tracked graph's replays: 2 rounds of 3 + 1 and the profile's
    # 2 + 20.
    assert cost["device_steps"] == 14 + 2 * 4 + 22
