"""Compressed training reaches synchronous accuracy on digits (2 workers, 3 seeds).

Each optimizer gets one horovodrun job that trains the digits conv net (examples/
digits.py) for 20 epochs at global batch 64 with every configuration and seeds 0-2:
the same split, budget and batch as the synchronous baseline trained in the same job.
Mean test accuracy must be within 1.0 percentage point of sync; the negative control
(top-k 0.1% without error feedback) must fall outside that band.
"""

import statistics
from pathlib import Path

import pytest
from conftest import assert_ok, run_workers

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).resolve().parents[1] / "benchmarks" / "_digits_worker.py"
MUST_MATCH = ["fp16", "bf16", "topk-1pct", "qsgd", "efsign", "powersgd-r2"]
NEGATIVE_CONTROL = "topk-0.1pct-no-ef"
SEEDS = [0, 1, 2]
BAND = 0.010


def mean_accuracies(out_dir, run):
    rows = run.results(out_dir, 2)
    assert [r["accuracy"] for r in rows[0]] == [r["accuracy"] for r in rows[1]]  # global evaluate
    by_config = {}
    for row in rows[0]:
        by_config.setdefault(row["config"], []).append(row["accuracy"])
    assert all(len(v) == len(SEEDS) for v in by_config.values()), by_config
    return {config: statistics.mean(v) for config, v in by_config.items()}, by_config


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mean_accuracy_within_one_point_of_sync(tmp_path, optimizer):
    configs = ["sync", *MUST_MATCH, NEGATIVE_CONTROL]
    run = run_workers(WORKER, 2, ["--out", tmp_path, "--optimizer", optimizer, "--epochs", 20,
                                  "--seeds", *SEEDS, "--configs", *configs], timeout=1500)
    assert_ok(run)
    means, each = mean_accuracies(tmp_path, run)
    table = "\n".join(f"{c:>18}: mean {means[c]:.4f}  seeds {each[c]}" for c in configs)
    print(f"\n{optimizer}:\n{table}")
    for config in MUST_MATCH:
        assert means["sync"] - means[config] <= BAND, f"{config} too far below sync:\n{table}"
    assert means["sync"] - means[NEGATIVE_CONTROL] > BAND, f"negative control inside the band:\n{table}"
