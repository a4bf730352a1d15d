"""Heterogeneity-aware shares (`balance=`): exact global-batch semantics with uneven shares,
deterministic shares that always sum to the batch, and clear errors.

The multiprocess tests compare uneven static shares on 2 and 3 workers with one plain
process at the same global batch (64 rows, 23 steps: 22 full batches and one of 29 rows),
for an MLP and for a conv net with synchronized batch norm; `--unweighted` (the exchange
ignores the rows) is the negative control.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_ok, run_plain, run_workers

from tfdp.strategies.balance import WEIGHT_SCALE, check_balance, next_weights, normalise, share_bounds

EXACT = 1e-5


def bounds(n, weights):
    return share_bounds(tf.constant(n, tf.int64), tf.constant(weights, tf.int64)).numpy().tolist()


@pytest.mark.parametrize("weights", [[7000, 3000], [5000, 3000, 2000], [1, 1, 1, 1], [9990, 5, 5], [3, 0, 7]])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 29, 64, 1000])
def test_shares_sum_to_the_batch_and_give_every_weighted_worker_a_row(n, weights):
    b = bounds(n, weights)
    rows = np.diff(b)
    assert b[0] == 0 and b[-1] == n and np.all(rows >= 0)
    positive = [w > 0 for w in weights]
    if n >= sum(positive):
        assert all(r >= 1 for r, p in zip(rows, positive) if p)  # no worker starves unless told (weight 0)
    assert all(r == 0 for r, p in zip(rows, positive) if not p)
    if n >= 1000:  # proportional up to rounding
        np.testing.assert_allclose(rows / n, np.array(weights) / sum(weights), atol=len(weights) / n + 1e-9)


def test_normalise_is_integer_and_sums_to_the_scale():
    for raw in ([0.7, 0.3], [1, 1, 1], [5, 3, 2], [1e-9, 1, 1]):
        w = normalise(raw)
        assert w.dtype == np.int64 and w.sum() == WEIGHT_SCALE
    assert normalise([1, 1, 1]).tolist() == [3334, 3333, 3333]


def test_next_weights_follow_speed_with_smoothing_and_hysteresis():
    # Worker 1 twice as slow: target shares 2/3, 1/3; half the way with smoothing 0.5.
    assert next_weights([5000, 5000], [320, 320], [1.0, 2.0]).tolist() == [5833, 4167]
    assert next_weights([5000, 5000], [320, 320], [1.0, 2.0], smoothing=1.0).tolist() == [6667, 3333]
    # 4% apart: within the 5% hysteresis, the shares stay put (no oscillation on noise).
    assert next_weights([5000, 5000], [320, 320], [1.0, 1.04]).tolist() == [5000, 5000]
    # Converged: the measured speeds match the shares, nothing moves.
    assert next_weights([6667, 3333], [427, 213], [1.0, 1.0]).tolist() == [6667, 3333]
    # A share more than 5% off its target is corrected, even when each step is half the way
    # (the full tier once left 0.47/0.53 in place for equal workers: 0.86x sync).
    assert next_weights([4716, 5284], [320, 320], [1.0, 1.0]).tolist() == [4858, 5142]
    # No measurement yet (0 rows): keep the shares.
    assert next_weights([5000, 5000], [0, 0], [0.0, 0.0]).tolist() == [5000, 5000]


@pytest.mark.parametrize("balance, message", [
    ([0.5, 0.3, 0.2], "has 3 weights but the job has 2 workers"),
    ([-1, 2], "must be >= 0"),
    ([0, 0], "positive sum"),
    ("fast", "must be None, 'auto' or a list"),
    ([True, False], "must be None, 'auto' or a list"),
])
def test_bad_balance_names_the_problem(balance, message):
    with pytest.raises(ValueError, match=message):
        check_balance(balance, 2)


def run_case(tmp_path, name, np_, *args):
    out = tmp_path / name
    out.mkdir()
    run = run_workers("balance.py", np_, ["--out", out, *args], timeout=240) if np_ > 1 else \
        run_plain("balance.py", ["--out", out, *args], timeout=240)
    assert_ok(run)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]


def max_relative(a, b):
    return max(float(np.max(np.abs(np.subtract(x, y))) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b))


def assert_follows(reference, ranks, workers_weights=None):
    for rank, result in enumerate(ranks):
        assert result["steps"] == reference["steps"]
        if workers_weights is not None:
            # Rows per step follow the weights: the first full batch of 64 splits as share_bounds says.
            assert result["epoch_rows"][0] == np.diff(bounds(64, normalise(workers_weights).tolist()))[rank]
            assert result["stats"]["shares"] == pytest.approx(np.array(workers_weights) / sum(workers_weights),
                                                              abs=1e-4)
        difference = max_relative(result["weights"], reference["weights"])
        print(f"\nrank {rank}: weights vs one process {difference:.2e}")
        assert difference <= EXACT
        # Logs and evaluate are global and exact too (row-weighted means of the ranks' metrics).
        for key in ("loss", "accuracy"):
            assert result["history"][key] == pytest.approx(reference["history"][key], rel=EXACT)
            assert result["evaluate"][key] == pytest.approx(reference["evaluate"][key], rel=EXACT)


@pytest.mark.multiprocess
@pytest.mark.full  # quick: the shares' arithmetic above and auto shares' trajectory below (stop 27, for time)
def test_uneven_static_shares_follow_the_one_process_trajectory(tmp_path, mlp_reference):
    ranks = run_case(tmp_path, "balanced", 2, "--model", "mlp", "--balance", "0.7,0.3", "--epochs", "2")
    assert mlp_reference["steps"] == 46
    assert_follows(mlp_reference, ranks, [0.7, 0.3])


@pytest.mark.multiprocess
@pytest.mark.full
def test_the_same_shares_without_row_weighting_end_elsewhere(tmp_path, mlp_reference):
    [control, _] = run_case(tmp_path, "unweighted", 2, "--model", "mlp", "--balance", "0.7,0.3", "--epochs", "2",
                            "--unweighted")
    assert max_relative(control["weights"], mlp_reference["weights"]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.full
@pytest.mark.parametrize("model, workers, balance", [("conv", 3, "0.5,0.3,0.2"), ("mlp", 3, "0.5,0.3,0.2"),
                                                     ("conv", 2, "0.7,0.3")])
def test_uneven_shares_on_more_workers_and_with_synchronized_batch_norm(tmp_path, model, workers, balance):
    [reference] = run_case(tmp_path, "reference", 1, "--model", model)
    ranks = run_case(tmp_path, "balanced", workers, "--model", model, "--balance", balance)
    assert reference["steps"] == 23
    assert_follows(reference, ranks, [float(w) for w in balance.split(",")])


@pytest.mark.multiprocess
def test_auto_shares_keep_the_trajectory_exact(tmp_path, mlp_reference):
    # Whatever shares the measurements choose (they may change at step 20 and 40), every
    # step's gradient is the global batch's: the weights still equal one process's.
    ranks = run_case(tmp_path, "auto", 2, "--model", "mlp", "--balance", "auto", "--epochs", "2")
    assert_follows(mlp_reference, ranks)
    for result in ranks:
        stats = result["stats"]
        assert len(stats["speeds_rows_per_second"]) == 2 and sum(stats["shares"]) == pytest.approx(1.0)
    assert ranks[0]["stats"] == ranks[1]["stats"]  # every rank computed the same shares


@pytest.mark.multiprocess
@pytest.mark.full
def test_a_worker_slowed_twofold_gets_about_a_third_of_each_batch(tmp_path):
    """Rank 1 under a CPU quota of half a CPU (root): its share falls from 1/2 towards 1/3."""
    from tfdp.tools import slowdown

    if slowdown._layout() is None:
        pytest.skip("no cgroup cpu controller here")
    [reference] = run_case(tmp_path, "reference", 1, "--model", "wide", "--epochs", "2")
    out = tmp_path / "slowed"
    out.mkdir()
    run = run_workers("balance.py", 2, ["--out", out, "--model", "wide", "--balance", "auto", "--epochs", "2"],
                      timeout=300, env={"TFDP_SLOWDOWN": "1:2", "TF_NUM_INTRAOP_THREADS": "1",
                                        "TF_NUM_INTEROP_THREADS": "1"})
    slowdown.remove_groups()
    assert_ok(run)
    result = json.loads((out / "rank0.json").read_text())
    shares = result["stats"]["shares"]
    print(f"\nshares with rank 1 slowed 2x: {shares}; history {result['stats']['history']}")
    assert 0.20 <= shares[1] <= 0.42 and result["stats"]["changes"] >= 1
    assert max_relative(result["weights"], reference["weights"]) <= EXACT


def test_balance_with_error_feedback_is_refused_and_named():
    import tfdp

    with pytest.raises(ValueError, match="error_feedback=False"):
        tfdp.CompressedStrategy("fp16", balance=[1])
    strategy = tfdp.CompressedStrategy("fp16", error_feedback=False, balance=[1])
    assert strategy.balance_stats() is None  # one process: nothing to balance
    with pytest.raises(ValueError, match="one weight per worker"):
        tfdp.MirroredStrategy(balance=[0.5, 0.5])  # this process is a job of one worker


@pytest.mark.multiprocess
@pytest.mark.full
def test_uneven_shares_compose_with_sharded_optimizer_state(tmp_path, mlp_reference):
    # zero1's reduce-scatter weights each rank's gradient by its rows too: 70/30 shares with each
    # worker keeping half of the optimizer state still follow one process.
    ranks = run_case(tmp_path, "sharded", 2, "--model", "mlp", "--balance", "0.7,0.3", "--epochs", "2", "--shard")
    assert_follows(mlp_reference, ranks, [0.7, 0.3])
