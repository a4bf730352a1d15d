"""`tfdp run --timeline FILE` writes Horovod's timeline; `tfdp timeline FILE` reads and draws it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tfdp.tools import timeline

TFDP = str(Path(sys.executable).parent / "tfdp")

# Two tracks; the all-reduce has a phase nested in another; the array is left open, as a job
# that was ended leaves it.
TRACE = """[
{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1}},
{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "HorovodAllreduce"}},
{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 100, "pid": 1}, {"ph": "E", "ts": 1100, "pid": 1},
{"ph": "B", "name": "ALLREDUCE", "ts": 1200, "pid": 1}, {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1300, "pid": 1},
{"ph": "E", "ts": 3300, "pid": 1}, {"ph": "E", "ts": 3400, "pid": 1},
{"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "HorovodAllgather"}},
{"ph": "B", "name": "ALLGATHER", "ts": 5000, "pid": 2}, {"ph": "E", "ts": 5500, "pid": 2},
{"ph": "B", "name": "ALLGATHER", "ts": 9000, "pid": 2},"""


def test_phases_pair_up_per_track_with_their_nesting(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(TRACE)
    spans = timeline.load(path)
    assert [(s.track, s.name, s.duration, s.depth) for s in spans] == [
        ("HorovodAllreduce", "NEGOTIATE_ALLREDUCE", 1000, 0), ("HorovodAllreduce", "ALLREDUCE", 2200, 0),
        ("HorovodAllreduce", "GLOO_ALLREDUCE", 2000, 1), ("HorovodAllgather", "ALLGATHER", 500, 0)]
    totals = timeline.summary(spans)  # the unfinished all-gather at 9000 is not a span
    assert totals["ALLGATHER"] == {"count": 1, "total_ms": 0.5, "median_ms": 0.5}
    timeline.draw(spans, tmp_path / "all.png", last_ms=10)
    assert (tmp_path / "all.png").stat().st_size > 5000
    with pytest.raises(ValueError, match="nothing in the 1 ms before 20 ms; the timeline spans 0 to 5.5 ms"):
        timeline.draw(spans, tmp_path / "none.png", last_ms=1, end_ms=20)


@pytest.mark.multiprocess
def test_tfdp_run_writes_a_timeline_that_tfdp_timeline_reads(tmp_path):
    code = ("import horovod.tensorflow as hvd, tensorflow as tf; hvd.init(); "
            "[hvd.allreduce(tf.ones([1000]), name='t%d' % i) for i in range(6)]; hvd.shutdown()")
    trace, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    run = subprocess.run([TFDP, "run", "-np", "2", "--timeline", str(trace), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    json.loads(trace.read_text().rstrip().rstrip(",") + ("" if trace.read_text().rstrip().endswith("]") else "]"))
    shown = subprocess.run([TFDP, "timeline", str(trace), "--png", str(png)], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    counts = {line.split()[0]: int(line.split()[1]) for line in shown.stdout.splitlines()[1:] if line[:1].isupper()
              and len(line.split()) == 4}
    # Horovod's writer may stop inside the last collective at exit: at least the first 5 of 6.
    assert counts["GLOO_ALLREDUCE"] in (5, 6) and png.stat().st_size > 5000
    missing = subprocess.run([TFDP, "run", "-np", "2", "--timeline", str(tmp_path / "no" / "t.json"), "true"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "does not exist; create it first" in missing.stderr
