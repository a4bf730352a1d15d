"""Run one benchmark worker script on 2 local workers under horovodrun; return each rank's JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TFDP_VERBOSE_WORKERS": "1"}


def run_job(worker, out, args, timeout):
    """Run `worker --out OUT *args` on 2 workers; return [rank0 results, rank1 results]."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    cmd = [str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(worker),
           "--out", str(out), *map(str, args)]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"benchmark job failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
