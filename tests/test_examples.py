"""The digits example trains to >= 95% test accuracy on one and on two workers."""

import os
import re
import sys
from pathlib import Path

import pytest
from conftest import QUIET_ENV, run_plain

from tfdp.tools.launcher import run_process

pytestmark = pytest.mark.multiprocess
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def accuracies(output):
    return [float(a) for a in re.findall(r"test accuracy: ([0-9.]+)", output)]


def tfdp_run(*args, env):
    """`tfdp run ...` as a user types it (the console script beside this Python)."""
    return run_process([str(Path(sys.executable).parent / "tfdp"), "run", *map(str, args)], timeout=300,
                       env={**os.environ, **QUIET_ENV, **env})


@pytest.mark.full
def test_digits_one_process():
    run = run_plain(EXAMPLE, timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    [accuracy] = accuracies(run.output)
    assert accuracy >= 0.95


def test_digits_on_two_workers_through_plain_horovodrun_with_one_progress_bar():
    # The README's command, horovodrun itself (not tfdp's launcher). TFDP_VERBOSE_WORKERS=1 keeps
    # rank 1's stdout, so the progress bar staying on rank 0 is the callback hook's doing.
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    run = run_process([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(EXAMPLE),
                       "--epochs", "15", "--verbose", "1"], timeout=300,
                      env={**os.environ, **QUIET_ENV, "TFDP_VERBOSE_WORKERS": "1"})
    assert run.returncode == 0, run.output[-3000:]
    progress_lines = [line for line in run.output.splitlines() if "/step" in line]
    assert progress_lines and all(line.startswith("[0]<stdout>") for line in progress_lines), progress_lines
    accuracy = accuracies(run.output)
    assert len(accuracy) == 2 and accuracy[0] == accuracy[1] >= 0.95, accuracy  # stdout really is on


@pytest.mark.full
@pytest.mark.timeout(3000)
def test_every_shipped_preset_trains_the_example_within_a_point_of_sync():
    # Issue 12's acceptance: `tfdp run -np 2 --strategy P examples/digits.py`, as a user types it.
    import tfdp

    results = {}
    for preset in tfdp.preset_names():
        run = tfdp_run("-np", 2, "--strategy", preset, EXAMPLE, env={"TFDP_VERBOSE_WORKERS": "0"})
        assert run.returncode == 0, (preset, run.output[-3000:])
        [results[preset]] = accuracies(run.output)
        print(f"{preset}: {results[preset]:.4f} in {run.seconds:.0f} s", flush=True)
    print("\n" + "\n".join(f"{p}: {a:.4f} ({100 * (a - results['sync']):+.2f} pp)" for p, a in results.items()))
    behind = {p: a for p, a in results.items() if a < results["sync"] - 0.01}
    assert not behind, (behind, results["sync"])
