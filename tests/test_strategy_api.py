"""The tf.distribute API of tfdp.MirroredStrategy across two real workers."""

import numpy as np
import pytest
from conftest import assert_ok, run_workers

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    run = run_workers("api.py", 2, ["--out", out])
    assert_ok(run)
    return run.results(out, 2)


def test_replicas_are_workers(results):
    for rank, r in enumerate(results):
        assert (r["rank"], r["size"], r["num_replicas_in_sync"], r["local_results_len"]) == (rank, 2, 2, 1)


def test_reduce_and_all_reduce(results):
    # Rank r contributes [r+1, 10(r+1)].
    for r in results:
        assert r["reduce_sum"] == [3.0, 30.0]
        assert r["reduce_mean"] == [1.5, 15.0]
        assert r["reduce_sum_axis0"] == 33.0
        assert r["reduce_mean_axis0"] == 8.25
        assert (r["replica_all_reduce_sum"], r["replica_all_reduce_mean"]) == (3.0, 1.5)


def test_unseeded_shuffle_partitions_the_data(results):
    for r in results:
        assert r["shuffled_rows_shared_seed"] == list(range(16))
        # Control: with a different seed per rank the ranks' rows overlap.
        assert r["shuffled_rows_own_seeds"] != list(range(16))


def test_gather_in_rank_order(results):
    for r in results:
        assert r["gather_axis0"] == [[0.0], [0.0], [1.0], [1.0]]
        assert r["gather_axis1"] == [[0.0, 1.0], [0.0, 1.0]]


def test_datasets_split_global_batches(results):
    assert results[0]["distributed_dataset"] == [[0, 1], [4, 5], [8]]
    assert results[1]["distributed_dataset"] == [[2, 3], [6, 7], [9]]
    assert results[0]["datasets_from_function"] == [[0, 2], [4, 6]]
    assert results[1]["datasets_from_function"] == [[1, 3], [5, 7]]
    assert [r["values_from_function"] for r in results] == [0.0, 1.0]


def test_predict_all_rows_in_order_and_global_evaluate(results):
    for r in results:
        assert r["predict_shape"] == [103, 1]
        assert r["predict_max_abs_error"] < 1e-5
        assert r["evaluate"] == pytest.approx(r["evaluate_expected"], rel=1e-5)
    assert results[0]["evaluate"] == results[1]["evaluate"]


def test_global_step_logs_option(results):
    on = [r["global_step_logs=True"] for r in results]
    off = [r["global_step_logs=False"] for r in results]
    # Epoch logs are global either way; the training itself is the same.
    assert on[0]["epoch"] == on[1]["epoch"] == off[0]["epoch"] == off[1]["epoch"]
    # Batch logs: identical on every rank by default, each rank's own with False.
    assert on[0]["batch"] == on[1]["batch"]
    assert off[0]["batch"] != off[1]["batch"]
    assert off[0]["batch"] != on[0]["batch"]


def test_jit_compile_true_falls_back_without_xla_and_warns_once(results):
    # keras/src/trainers/trainer.py turns XLA off, warning, for models it cannot compile; tfdp does
    # the same for steps that hold Horovod collectives, under a strategy and a DistributedOptimizer.
    for name in ("strategy", "distributed_optimizer"):
        first, second = (r[f"xla_{name}"] for r in results)
        assert (first["jit_compile"], second["jit_compile"]) == (False, False)
        assert (first["warned"], second["warned"]) == (1, 0)  # rank 0 only
        assert first["weights"] == second["weights"]
    # Both follow one process's batch-16 SGD: the strategy splits each global batch of 16, and
    # under the DistributedOptimizer every worker fits all of (x, y) at 16 rows per step.
    by_strategy, by_optimizer = (results[0][f"xla_{name}"]["weights"] for name in ("strategy", "distributed_optimizer"))
    for a, b in zip(by_strategy, by_optimizer):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A custom step compiled by XLA cannot be rewritten: a ValueError that names the fix, on every rank.
    for r in results:
        assert "cannot be compiled by XLA" in r["xla_custom_step_error"]
        assert "Pass jit_compile=False to tf.function" in r["xla_custom_step_error"]


def test_custom_loop_under_a_preset_of_own_models_ends_as_one_model_after_settle(results):
    # topk-1pct keeps what compression held back in each worker's model: after 7 steps the
    # ranks differ (the control), and `strategy.settle` leaves every rank with their average.
    before = [r["custom_loop_before_settle"] for r in results]
    after = [r["custom_loop_after_settle"] for r in results]
    assert before[0] != before[1]
    assert after[0] == after[1]
    for a, b0, b1 in zip(after[0], *before):
        np.testing.assert_allclose(a, (np.array(b0) + np.array(b1)) / 2, atol=1e-6)


def test_saving_on_every_rank_writes_once_on_rank_0(results):
    # Both ranks call save_weights, save, keras.saving.save_model and fit with a CSVLogger, each
    # also to a path of its own: only rank 0's files exist, and both ranks load rank 0's.
    for r in results:
        assert r["saved_files"] == ["log-rank0.csv", "model-rank0.keras", "model.keras", "model.weights.h5"]
        assert r["loaded_equals_own"]
