"""Compressed and asynchronous training reach synchronous accuracy on digits.

Each (family, optimizer) gets one horovodrun job (2 workers) that trains the digits
conv net (examples/digits.py) for 20 epochs at global batch 64 with every configuration
of the family and seeds 0-2, next to the synchronous baseline in the same job: the same
split, budget and batch. Mean test accuracy must be within 1.0 percentage point of
sync; each family's negative control must fall outside that band.
"""

import statistics
from pathlib import Path

import pytest
from conftest import assert_ok, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.full]
WORKER = Path(__file__).resolve().parents[1] / "benchmarks" / "_digits_worker.py"
FAMILIES = {
    # Negative controls: top-k 0.1% without error feedback; staleness 8.
    "compressed": (["fp16", "bf16", "topk-1pct", "qsgd", "efsign", "powersgd-r2"], "topk-0.1pct-no-ef"),
    "async": (["async-s1", "async-s2", "local-h4", "local-h16", "local-h16-warmup"], "async-s8"),
}
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


@pytest.mark.parametrize("family, optimizer", [("compressed", "sgd"), ("compressed", "adam"),
                                               ("async", "adam")])
def test_mean_accuracy_within_one_point_of_sync(tmp_path, family, optimizer):
    must_match, negative_control = FAMILIES[family]
    configs = ["sync", *must_match, negative_control]
    run = run_workers(WORKER, 2, ["--out", tmp_path, "--optimizer", optimizer, "--epochs", 20,
                                  "--seeds", *SEEDS, "--configs", *configs], timeout=1500)
    assert_ok(run)
    means, each = mean_accuracies(tmp_path, run)
    table = "\n".join(f"{c:>18}: mean {means[c]:.4f}  seeds {each[c]}" for c in configs)
    print(f"\n{family} / {optimizer}:\n{table}")
    for config in must_match:
        assert means["sync"] - means[config] <= BAND, f"{config} too far below sync:\n{table}"
    for row in run.results(tmp_path, 2)[0]:
        assert row["stats"]["rounds"] == expected_rounds(row["config"], row["stats"]["steps"]), row


def expected_rounds(config, steps):
    """Exchanges per fit: one per step, or one per H local steps (after warm-up) plus the
    average at the end of fit when steps are left over."""
    if not config.startswith("local-h"):
        return steps
    every = int(config.split("-")[1][1:])
    warmup = 40 if config.endswith("-warmup") else 0
    return warmup + -(-(steps - warmup) // every)
