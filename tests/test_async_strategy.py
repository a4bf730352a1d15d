"""AsyncStrategy on 2 real workers: exact delayed-averaging, stale-gradient and local-SGD
semantics, the staleness bound under a deliberately slow rank, rounds, identical weights."""


import numpy as np
import pytest
from conftest import assert_ok, load_without_tfdp, run_workers

import tfdp

pytestmark = pytest.mark.multiprocess
STEPS = 12


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    run = run_workers("asynchronous.py", 2, ["--out", out], timeout=420)
    assert_ok(run)
    return out, run.results(out, 2)


@pytest.fixture(scope="module")
def results(job):
    return job[1]


def max_relative_difference(a, b):
    return max(np.max(np.abs(np.subtract(x, y))) / (np.max(np.abs(y)) + 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["s0", "s1", "s2"])
def test_delayed_averaging_swaps_each_own_step_for_the_average_s_steps_later(results, case):
    rank0, _ = results
    assert max_relative_difference(rank0[case]["weights"], rank0[f"ref-{case}"]) < 1e-5
    # Negative controls: another staleness, or stale gradients, is another trajectory.
    other = {"s0": "ref-s1", "s1": "ref-s2", "s2": "ref-s0"}[case]
    assert max_relative_difference(rank0[case]["weights"], rank0[other]) > 1e-3
    if case != "s0":
        assert max_relative_difference(rank0[case]["weights"], rank0[f"ref-stale-{case}"]) > 1e-3


def test_validation_inside_fit_evaluates_the_average_of_the_workers_models(results):
    # The workers differ by their last two steps when the epoch's validation runs: it reports the
    # loss of their average, and every worker then trains on from its own model (the weights at
    # the end equal the reference without validation).
    rank0, rank1 = results
    reference = rank0["ref-s2-validation"]
    assert rank0["s2-validation"]["val_loss"] == rank1["s2-validation"]["val_loss"]
    assert abs(rank0["s2-validation"]["val_loss"] - reference["average"]) <= 1e-5 * reference["average"]
    assert abs(reference["own"] - reference["average"]) > 1e-3 * reference["average"]  # what it is not
    assert max_relative_difference(rank0["s2-validation"]["weights"], rank0["ref-s2"]) < 1e-5


@pytest.mark.parametrize("case", ["stale-s0", "stale-s1", "stale-s2"])
def test_stale_gradients_apply_exactly_the_gradient_of_step_t_minus_s(results, case):
    rank0, _ = results
    reference = rank0[f"ref-{case}"]
    assert max_relative_difference(rank0[case]["weights"], reference) < 1e-5
    # Negative control: a different staleness is a different trajectory.
    other = {"stale-s0": "ref-stale-s1", "stale-s1": "ref-stale-s2", "stale-s2": "ref-stale-s0"}[case]
    assert max_relative_difference(rank0[case]["weights"], rank0[other]) > 1e-3


@pytest.mark.parametrize("case", ["stale-s0"])
def test_staleness_zero_is_synchronous(results, case):
    # Delayed averaging at s=0 averages each worker's own step: under plain SGD the same update
    # up to rounding, so it is held to the per-worker reference above instead.
    rank0, _ = results
    assert max_relative_difference(rank0[case]["weights"], rank0["sync"]["weights"]) < 1e-6


@pytest.mark.parametrize("case", ["h4", "h5"])
def test_local_sgd_matches_per_worker_steps_plus_averaging(results, case):
    rank0, _ = results
    assert max_relative_difference(rank0[case]["weights"], rank0[f"ref-{case}"]) < 1e-5
    other = "ref-h5" if case == "h4" else "ref-h4"
    assert max_relative_difference(rank0[case]["weights"], rank0[other]) > 1e-4


@pytest.mark.parametrize("case, rounds", [("sync", STEPS), ("stale-s1", STEPS), ("s1", STEPS + 1), ("h4", STEPS // 4),
                                          ("h5", 3)])
def test_rounds_are_counted_not_computed(results, case, rounds):
    # h5 over 12 steps: averages after steps 5 and 10, and one at the end of fit; delayed
    # averaging: one exchange per step, and the models averaged once when fit ends.
    for rank in results:
        assert rank[case]["stats"]["steps"] == STEPS
        assert rank[case]["stats"]["rounds"] == rounds


@pytest.mark.parametrize("case, bound", [("sync", 0), ("s0", 0), ("s1", 1), ("s2", 2), ("stale-s2", 2), ("h4", 3),
                                         ("slow-s2", 2), ("slow-s4", 4)])
def test_max_staleness_reported_within_the_bound(results, case, bound):
    for rank in results:
        assert rank[case]["stats"]["max_staleness"] == bound


@pytest.mark.parametrize("case", ["s1", "s2", "stale-s1", "stale-s2", "slow-s2", "slow-s4", "h4"])
def test_both_ranks_end_with_the_same_model(results, case):
    rank0, rank1 = results
    assert rank0[case]["weights"] == rank1[case]["weights"]
    if case.startswith("stale"):  # stale gradients: the same weights after every step
        assert rank0[case]["checksums"] == rank1[case]["checksums"]
    elif case in ("s1", "s2", "h4"):  # own steps: the workers differ until they are averaged
        assert rank0[case]["checksums"][-2] != rank1[case]["checksums"][-2]


def lead(fast_times, slow_times):
    """Largest number of steps the fast rank had finished beyond the slow one (same clock)."""
    return max(sum(t <= moment for t in fast_times) - sum(t <= moment for t in slow_times)
               for moment in fast_times)


@pytest.mark.parametrize("case, staleness", [("slow-s0", 0), ("slow-s2", 2), ("slow-s4", 4)])
def test_slow_rank_holds_the_others_back_only_as_far_as_the_bound(results, case, staleness):
    # Rank 1 sleeps 0.15 s before each step. Rank 0 ends step t only once rank 1 has
    # submitted step t - s, so it can be at most s + 1 finished steps ahead, and with
    # a slow partner it does use that slack.
    rank0, rank1 = results
    measured = lead(rank0[case]["times"], rank1[case]["times"])
    assert measured <= staleness + 1, measured
    assert measured >= staleness, measured
    assert rank0[case]["stats"]["blocked_seconds"] > rank1[case]["stats"]["blocked_seconds"]


# Local SGD's (h4) in the full tier, to keep the quick tier within its 12 minutes.
@pytest.mark.parametrize("case", ["s1", pytest.param("h4", marks=pytest.mark.full)])
def test_evaluate_predict_and_save_keep_the_contract(job, case):
    out, (rank0, rank1) = job
    assert rank0[case]["evaluate"] == rank1[case]["evaluate"]  # global, identical
    assert abs(rank0[case]["evaluate"] - rank0[case]["numpy_mse"]) <= 1e-5 * rank0[case]["numpy_mse"]
    assert rank0[case]["predict_rows"] == rank1[case]["predict_rows"] == 50
    assert load_without_tfdp(out / f"{case}.keras")["optimizer"] == "SGD"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"staleness": -1}, r"`staleness` must be an integer >= 0. Received: staleness=-1"),
        ({"sync_every": 0}, r"`sync_every` must be an integer >= 1. Received: sync_every=0"),
        ({"staleness": 1, "sync_every": 4}, r"Pass either `staleness`"),
        ({"staleness": 1, "damping": "momentum"}, r"`damping` must be one of \(None, 'lr'\)"),
        ({"staleness": 1, "damping": "lr"}, r"Pass method='stale_gradients' with them"),
        ({"staleness": 1, "momentum": "auto"}, r"Pass method='stale_gradients' with them"),
        ({"staleness": 1, "method": "gossip"}, r"`method` applies to bounded staleness and must be one of"),
        ({"sync_every": 4, "method": "stale_gradients"}, r"`method` applies to bounded staleness"),
        ({"staleness": 1, "warmup_steps": 5}, r"`warmup_steps` applies to local SGD"),
        ({"sync_every": 4, "outer_momentum": 1.0}, r"`outer_momentum` must be in \[0, 1\)"),
    ],
)
def test_invalid_parameters_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdp.AsyncStrategy(**kwargs)
