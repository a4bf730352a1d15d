"""The rest of Keras keeps working under tfdp.MirroredStrategy (2 real workers vs 1 plain process).

Full tier: the quick tier covers the same features in `test_conformance.py` (clipnorm,
class_weight, validation, callbacks, rank-0-only files, mixed precision).
"""

import json

import numpy as np
import pytest
from conftest import assert_ok, load_without_tfdp, run_script
from test_equivalence import relative_differences

pytestmark = [pytest.mark.multiprocess, pytest.mark.full]


def train(tmp_path, mode, precision):
    out, files = tmp_path / f"{mode}-{precision}-out", tmp_path / f"{mode}-{precision}-files"
    out.mkdir()
    files.mkdir()
    args = ["--mode", mode, "--precision", precision, "--files", files, "--out", out]
    nworkers = 2 if mode == "tfdp" else 1
    run = run_script("keras_features.py", nworkers, args)
    assert_ok(run)
    return run.results(out, nworkers), files


@pytest.fixture(scope="module")
def float32_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    (reference,), _ = train(tmp, "plain", "float32")
    workers, files = train(tmp, "tfdp", "float32")
    return reference, workers, files


def test_clipnorm_class_weight_validation_callbacks_match_one_process(float32_runs):
    reference, (rank0, rank1), _ = float32_runs
    # clipnorm clips every step here; clipping local gradients would not match.
    assert max(relative_differences(rank0["weights"], reference["weights"])) <= 1e-5
    assert len(rank0["history"]["loss"]) == 4  # epochs x steps_per_epoch ran
    for key, values in reference["history"].items():
        np.testing.assert_allclose(rank0["history"][key], values, rtol=1e-5, err_msg=key)
    # ReduceLROnPlateau acted identically (global logs on every rank).
    assert rank0["history"]["learning_rate"] == rank1["history"]["learning_rate"]
    assert rank0["history"]["learning_rate"][-1] < rank0["history"]["learning_rate"][0]
    assert rank0["history"] == rank1["history"]


def test_only_rank0_writes_files(float32_runs):
    _, (rank0, rank1), files = float32_runs
    assert (rank0["checkpoint_saves"], rank1["checkpoint_saves"]) == (4, 0)
    assert len(list((files / "tb" / "train").glob("events.out.tfevents.*"))) == 1
    metadata = json.loads((files / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 4


def test_saved_model_loads_in_plain_keras_without_tfdp(float32_runs):
    _, (rank0, _), files = float32_runs
    x = np.random.default_rng(5).normal(size=(1024, 12)).astype("float32")[:10]
    loaded = load_without_tfdp(files / "model.keras", x.tolist())
    assert loaded["optimizer"] == "SGD"
    np.testing.assert_allclose(loaded["predictions"], rank0["predictions"], rtol=1e-6, atol=1e-7)


def test_mixed_precision_loss_scale_optimizer(tmp_path):
    (reference,), _ = train(tmp_path, "plain", "mixed")
    (rank0, rank1), _ = train(tmp_path, "tfdp", "mixed")
    assert rank0["optimizer"] == "LossScaleOptimizer"
    # float16 compute: a looser bound than float32, same trajectory.
    assert max(relative_differences(rank0["weights"], reference["weights"])) <= 1e-3
    for w0, w1 in zip(rank0["weights"], rank1["weights"]):
        assert np.array_equal(np.asarray(w0), np.asarray(w1))
