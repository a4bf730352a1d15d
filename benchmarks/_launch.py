"""Run one benchmark worker script on 2 local workers (tfdp's launcher, horovodrun); return each rank's JSON."""

import json
import os
import sys
from pathlib import Path

from tfdp.tools.launcher import launch

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TFDP_VERBOSE_WORKERS": "1"}


def run_job(worker, out, args, timeout, workers=2, rate_mbit=None):
    """Run `worker --out OUT *args` on `workers` workers (in emulated hosts linked at `rate_mbit`
    Mbit/s when given, root); return [rank 0 results, rank 1 results, ...]."""
    result = launch([sys.executable, str(worker), "--out", str(out), *map(str, args)], workers,
                    use_horovodrun=rate_mbit is None, rate_mbit=rate_mbit, timeout=timeout, env=ENV, sink=None)
    if result.returncode:
        raise RuntimeError(f"benchmark job failed (exit {result.returncode}):\n{result.output[-6000:]}")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(workers)]
