"""The digits example trains to >= 95% test accuracy on one and on two workers."""

import re
import sys
from pathlib import Path

import pytest
from conftest import BIN, _run

pytestmark = pytest.mark.multiprocess
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def accuracies(output):
    return [float(a) for a in re.findall(r"test accuracy: ([0-9.]+)", output)]


def test_digits_one_process():
    run = _run([sys.executable, str(EXAMPLE)], timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    [accuracy] = accuracies(run.output)
    assert accuracy >= 0.95


def test_digits_two_workers_prints_once():
    run = _run([str(BIN / "tfdp"), "run", "-np", "2", str(EXAMPLE)], timeout=300,
               env={"TFDP_VERBOSE_WORKERS": "0"})
    assert run.returncode == 0, run.output[-3000:]
    [accuracy] = accuracies(run.output)  # rank 1 stays quiet
    assert accuracy >= 0.95


def test_progress_bar_only_on_rank0_even_with_worker_stdout_on():
    # TFDP_VERBOSE_WORKERS=1 keeps rank 1's stdout, so this checks the callback hook itself.
    run = _run([str(BIN / "tfdp"), "run", "-np", "2", str(EXAMPLE), "--epochs", "1", "--verbose", "1"],
               timeout=300, env={"TFDP_VERBOSE_WORKERS": "1"})
    assert run.returncode == 0, run.output[-3000:]
    progress_lines = [line for line in run.output.splitlines() if "/step" in line]
    assert progress_lines and all(line.startswith("[0]<stdout>") for line in progress_lines), progress_lines
    assert len(accuracies(run.output)) == 2  # both ranks print their own line: stdout really is on
