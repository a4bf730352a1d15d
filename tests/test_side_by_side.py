"""The side-by-side baseline of `tfdp bench`: copies of the single worker start each timed phase together."""

import json
import multiprocessing
import os
import subprocess
import threading
import sys
import time
from pathlib import Path

import pytest
from conftest import QUIET_ENV

from tfdp.tools.side_by_side import Rendezvous, abandon


def _arrive_late(directory, seconds):
    time.sleep(seconds)
    Rendezvous(directory, copies=2)("phase")


def test_a_copy_waits_for_the_other_at_each_phase(tmp_path):
    late = multiprocessing.get_context("fork").Process(target=_arrive_late, args=(tmp_path, 0.6))
    start = time.monotonic()
    late.start()
    Rendezvous(tmp_path, copies=2)("phase")
    waited = time.monotonic() - start
    late.join(timeout=10)
    assert late.exitcode == 0
    assert waited >= 0.55  # it left only once the late copy had arrived
    # Negative control: a copy alone goes on at once.
    start = time.monotonic()
    Rendezvous(tmp_path / "alone", copies=1)("phase")
    assert time.monotonic() - start < 0.05


def test_a_missing_copy_is_an_error_that_says_so(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"2 copies should reach 'compressor qsgd', 1 did in 0.3 s"):
        Rendezvous(tmp_path, copies=2, timeout=0.3)("compressor qsgd")
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="`copies` must be an int >= 1"):
        Rendezvous(tmp_path, copies=0)


def test_a_copy_that_ended_releases_the_others_at_once(tmp_path):
    abandon(tmp_path)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="another copy ended before 'forward'"):
        Rendezvous(tmp_path, copies=2, timeout=60)("forward")
    assert time.monotonic() - start < 1  # not the 60 s timeout


def test_two_bench_workers_side_by_side_meet_before_every_timed_phase(tmp_path):
    meeting = tmp_path / "meeting"
    command = [sys.executable, "-m", "tfdp.tools.bench_worker", "--preset", "sync", "--params", "1e5",
               "--batch-size", "8", "--steps", "3", "--warmup-steps", "1", "--time-compressors", "topk-1pct",
               "--side-by-side", str(meeting), "2"]
    env = {**os.environ, **QUIET_ENV, "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
    copies = [subprocess.Popen(command + ["--out", str(tmp_path / f"copy{i}.json")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [c.communicate(timeout=240)[0] for c in copies]
    finally:
        for c in copies:
            c.kill()
    assert [c.returncode for c in copies] == [0, 0], outputs
    for phase in ("timed steps", "forward", "compressor topk-1pct"):
        assert len(list(meeting.glob(f"{phase}.*"))) == 2, phase
    assert len(list(meeting.iterdir())) == 6  # nothing else waited
    for i in range(2):  # the steps the bench pairs up by index, each copy's own
        result = json.loads((tmp_path / f"copy{i}.json").read_text())
        assert len(result["step_seconds"]) == 3
        assert len(result["compressor_step_seconds"]["topk-1pct"]) == 5  # never fewer than 5
        assert all(s > 0 for s in result["compressor_step_seconds"]["topk-1pct"])


def test_the_baseline_takes_each_step_s_slowest_copy(monkeypatch):
    """A synchronous step waits for its slowest worker: copies slow on alternate steps make a
    lockstep baseline slow on every step, where the median of each copy is fast half the time."""
    from tfdp.tools import bench

    copy_steps = iter([[0.010, 0.030, 0.010, 0.030, 0.010], [0.030, 0.010, 0.030, 0.010, 0.030]])
    lock = threading.Lock()

    def job(*args, extra=()):
        with lock:
            steps = next(copy_steps)
        return {"median_seconds": sorted(steps)[2], "forward_seconds": 0.004, "step_seconds": steps,
                "compressor_step_seconds": {"qsgd": [s / 2 for s in steps]}}

    monkeypatch.setattr(bench, "_job", job)
    combined = bench._side_by_side(2, "mlp", 1e5, 8, 3, 1, 1, 60, None, [], None, "sgd")
    assert combined["median_seconds"] == pytest.approx(0.030)
    assert combined["compressor_seconds"]["qsgd"] == pytest.approx(0.015)
    assert combined["alone_median_seconds"] == pytest.approx(0.020)  # what the median of medians said
    assert bench.lockstep_seconds([[1.0, 3.0, 2.0], [2.0, 1.0, 2.5]]) == 2.5


def test_the_bench_ends_every_copy_when_one_fails(monkeypatch):
    from tfdp.tools import bench

    calls, lock = [], threading.Lock()

    def job(preset, workers, rate_mbit, *args, extra=()):
        meeting, copies = extra[-2], int(extra[-1])
        with lock:
            calls.append(preset)
            first = len(calls) == 1
        if first:  # waits for the other copy: without `abandon` for 60 s
            Rendezvous(meeting, copies, timeout=60)("timed steps")
        # The second copy fails once the first is waiting (had it failed first, `map` could have
        # cancelled the other before it started).
        while not list(Path(meeting).glob("timed steps.*")):
            time.sleep(0.01)
        raise RuntimeError("bench job 'sync' on 1 worker(s) failed")

    monkeypatch.setattr(bench, "_job", job)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed|another copy ended"):
        bench._side_by_side(2, "mlp", 1e5, 8, 3, 1, 1, 60, None, [], None, "sgd")
    assert time.monotonic() - start < 10
    assert len(calls) == 2
