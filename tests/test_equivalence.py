"""P workers with global batch B follow the 1-process batch-B trajectory."""

import numpy as np
import pytest
from conftest import assert_ok, run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.full]


def relative_differences(weights, reference):
    """Per tensor: max |w - ref| / max |ref|."""
    return [
        float(np.max(np.abs(np.asarray(w) - np.asarray(r))) / (np.max(np.abs(np.asarray(r))) + 1e-30))
        for w, r in zip(weights, reference)
    ]


def train(tmp_path, model, mode, nworkers):
    out = tmp_path / f"{model}-{mode}"
    out.mkdir()
    args = ["--model", model, "--mode", mode, "--out", out]
    run = run_script("equivalence.py", nworkers, args)
    assert_ok(run)
    return run.results(out, nworkers)


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "mlp", "plain", 1)[0]


def test_mlp_two_workers_match_one_process(tmp_path, mlp_reference):
    rank0, rank1 = train(tmp_path, "mlp", "tfdp", 2)
    assert len(rank0["step_losses"]) >= 20
    assert max(relative_differences(rank0["weights"], mlp_reference["weights"])) <= 1e-5
    np.testing.assert_allclose(rank0["step_losses"], mlp_reference["step_losses"], rtol=1e-5)
    np.testing.assert_allclose(rank0["epoch_losses"], mlp_reference["epoch_losses"], rtol=1e-5)
    # Bit-identical weights and identical reported losses on every rank.
    for w0, w1 in zip(rank0["weights"], rank1["weights"]):
        assert np.array_equal(np.asarray(w0), np.asarray(w1))
    assert rank0["step_losses"] == rank1["step_losses"]
    # One gradient exchange per step, all of it in float32.
    stats = rank0["stats"]
    assert stats["steps"] == len(rank0["step_losses"])
    n_params = sum(np.asarray(w).size for w in rank0["weights"])
    assert stats["dense_bytes"] == stats["steps"] * n_params * 4
    assert stats["payload_bytes"] >= stats["dense_bytes"]


def test_negative_control_without_gradient_averaging_fails(tmp_path, mlp_reference):
    rank0, rank1 = train(tmp_path, "mlp", "no-average", 2)
    assert max(relative_differences(rank0["weights"], mlp_reference["weights"])) > 1e-2
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(rank0["weights"], rank1["weights"]))


def test_synchronized_batchnorm_matches_tf_mirrored_strategy(tmp_path):
    reference = train(tmp_path, "bn", "plain", 1)[0]
    tf_mirrored = train(tmp_path, "bn", "tf-mirrored", 1)[0]
    rank0, rank1 = train(tmp_path, "bn", "tfdp", 2)
    assert len(rank0["step_losses"]) >= 10
    ours = relative_differences(rank0["weights"], reference["weights"])
    theirs = relative_differences(tf_mirrored["weights"], reference["weights"])
    for i, (o, t) in enumerate(zip(ours, theirs)):
        assert o <= t + 1e-6, f"tensor {i}: tfdp differs by {o}, tf.distribute by {t}"
    np.testing.assert_allclose(rank0["step_losses"], reference["step_losses"], rtol=1e-5)
    for w0, w1 in zip(rank0["weights"], rank1["weights"]):
        assert np.array_equal(np.asarray(w0), np.asarray(w1))
