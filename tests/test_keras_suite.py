"""Keras's own trainer tests pass under tfdp on 2 workers, except where tfdp or the test cannot.

`keras/src/trainers/trainer_test.py` (shipped in the Keras wheel) runs under horovodrun with
every test inside a `tfdp.MirroredStrategy` scope (`tests/keras_suite/tfdp_scope_plugin.py`).
A failure is allowed only for one of the reasons below, each a documented limitation or a
test not written for several processes; any other failure fails this test.
"""

import json
import re
from pathlib import Path

import keras
import pytest
from conftest import run_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.full]
SUITE = Path(keras.__file__).parent / "src" / "trainers" / "trainer_test.py"
PLUGIN_DIR = Path(__file__).parent / "keras_suite"
ALLOWED = {
    # A global batch of 1 cannot give 2 workers a row each (tfdp says so on every rank).
    "batch of 1": r"The global batch size 1 is smaller than the number of workers \(2\)",
    # An optional data loader that is not installed here.
    "grain": r"No module named 'grain'",
}
# Tests not written for several processes, with the reason.
NOT_FOR_SEVERAL_PROCESSES = {
    # np.random.rand without a seed: each rank trains on different data.
    "test_fit_with_different_batch_size_same_loss": "unseeded data differs by rank",
    "test_evaluate_with_different_batch_size_same_loss": "unseeded data differs by rank",
}


def test_keras_trainer_tests_pass_under_tfdp_on_two_workers(tmp_path):
    run = run_command(["python", "-m", "pytest", "-p", "tfdp_scope_plugin", "-q", "-p", "no:cacheprovider",
                       "--timeout", "120", SUITE, "-k", "not jax and not torch"], 2, timeout=1800,
                      env={"PYTHONPATH": str(PLUGIN_DIR), "TFDP_KERAS_SUITE_OUT": str(tmp_path),
                           "TFDP_STEP_TIMEOUT_SECONDS": "60"})
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    outcomes = {r["test"]: r for r in records}
    failed = {name: r["error"] for name, r in outcomes.items() if r["outcome"] == "failed"}
    unexplained = {name: error for name, error in failed.items() if name not in NOT_FOR_SEVERAL_PROCESSES
                   and not any(re.search(pattern, error) for pattern in ALLOWED.values())}
    passed = sum(r["outcome"] == "passed" for r in records)
    print(f"\nKeras trainer_test under tfdp, 2 workers: {passed} passed, {len(failed)} failed "
          f"({len(failed) - len(unexplained)} for a documented reason), "
          f"{sum(r['outcome'] == 'skipped' for r in records)} skipped")
    assert not unexplained, unexplained
    assert passed >= 100, run.output[-3000:]
    # The named Keras tests of the conformance issue pass, and the tests of a model's own
    # compute_loss (they failed while its loss went undivided by the workers, before 073d820).
    for name in ("test_fit_with_custom_train_step", "test_evaluate_with_custom_test_step_dict",
                 "test_evaluate_with_custom_test_step_flat", "test_fit_sparse_tf_eager", "test_fit_sparse_tf_graph",
                 "test_metric_update_in_compute_loss", "test_compute_loss_no_training_backwards_compatibility",
                 "test_evaluate_with_custom_compute_loss"):
        assert outcomes[name]["outcome"] == "passed", outcomes[name]
