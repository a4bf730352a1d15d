"""Launch real workers with a hard timeout: a hang is a failure, never a wait."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
BIN = Path(sys.executable).parent
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TFDP_VERBOSE_WORKERS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def results(self, out_dir, nranks):
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nranks)]


def _run(cmd, timeout, env=None):
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=full_env, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s (hang): {' '.join(map(str, cmd))}\n{output[-4000:]}")
    return Run(proc.returncode, output, time.monotonic() - start)


def run_workers(script, np_=2, args=(), timeout=240, env=None):
    """Run `tests/workers/<script>` on `np_` workers under horovodrun (Gloo, localhost)."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           sys.executable, str(WORKERS / script), *map(str, args)]
    return _run(cmd, timeout, env)


def run_elastic(script, np_, min_np, max_np, discovery, args=(), timeout=300, env=None):
    """Run `tests/workers/<script>` under horovodrun's elastic mode with discovery script `discovery`."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", str(WORKERS / discovery), "--gloo",
           sys.executable, str(WORKERS / script), *map(str, args)]
    return _run(cmd, timeout, env)


def run_plain(script, args=(), timeout=240, env=None):
    """Run `tests/workers/<script>` as one plain process (no horovodrun)."""
    return _run([sys.executable, str(WORKERS / script), *map(str, args)], timeout, env)


def run_script(script, nworkers, args=(), timeout=240, env=None):
    """Run `script` on `nworkers` under horovodrun, or as one plain process when 1."""
    if nworkers > 1:
        return run_workers(script, nworkers, args, timeout, env)
    return run_plain(script, args, timeout, env)


def assert_ok(run):
    assert run.returncode == 0, run.output[-6000:]


def load_without_tfdp(model_path, inputs=None):
    """Load a saved model in a fresh Python that never imports tfdp.

    Returns its optimizer class name, parameter count and, given `inputs`, predictions.
    """
    code = (
        "import json, sys, numpy as np, keras\n"
        f"model = keras.saving.load_model({str(model_path)!r})\n"
        "x = json.loads(sys.stdin.read())\n"
        "assert 'tfdp' not in sys.modules\n"
        "predictions = None if x is None else model.predict(np.asarray(x, 'float32'), verbose=0).tolist()\n"
        "print(json.dumps({'optimizer': type(model.optimizer).__name__, "
        "'params': model.count_params(), 'predictions': predictions}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], input=json.dumps(inputs), capture_output=True,
                         text=True, timeout=120, env={**QUIET_ENV, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
