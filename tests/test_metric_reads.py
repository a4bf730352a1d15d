"""Metrics read outside a step (the end of every epoch, of evaluate) are reduced in one exchange
per dtype, not one per variable, a metrics reset exchanges nothing, and a step's logs exchange
does not wait for backprop (2 real workers)."""

import pytest
from conftest import assert_ok, run_script

pytestmark = pytest.mark.multiprocess


def test_epoch_end_metric_reads_are_one_exchange_per_dtype_and_resets_none(tmp_path):
    run = run_script("metric_reads.py", 2, ["--out", tmp_path])
    assert_ok(run)
    for rank in run.results(tmp_path, 2):
        # loss, accuracy and cross-entropy (float32 total and count each) and an int64 row count.
        assert rank["metric_variables"] == 7
        assert rank["collectives_one_by_one"] == 7  # Keras's own reads: one exchange per variable
        assert rank["collectives_together"] == 2  # one per dtype
        assert rank["together"] == rank["one_by_one"]
        assert rank["together"]["count"] == 96  # every rank's rows of the last epoch, not this rank's 48
        assert rank["together"] == pytest.approx(rank["epoch_logs"], rel=1e-6)
        assert rank["collectives_reset"] == 0
        assert rank["after_reset"] == [0.0] * 7
        # The step's logs exchange depends on the forward pass only, so it runs during backprop
        # rather than after the gradients; the gradient exchanges (control) do wait for backprop.
        waits = rank["collectives_waiting_for_backprop"]
        assert waits["logs"] == [False, False]  # one per dtype: float32 metrics, the int64 count
        assert waits["gradients"] and all(waits["gradients"])
