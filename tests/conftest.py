"""Launch real workers with a hard timeout: a hang is a failure, never a wait."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tfdp.tools.launcher import launch, run_process

WORKERS = Path(__file__).parent / "workers"
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TFDP_VERBOSE_WORKERS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def results(self, out_dir, nranks):
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nranks)]


def _finish(result, command, timeout):
    if os.environ.get("TFDP_TEST_JOBLOG"):  # one line per launched job: where the tier's time goes
        with open(os.environ["TFDP_TEST_JOBLOG"], "a") as log:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            log.write(f"{result.seconds:7.1f} {test} {' '.join(map(str, command))[-120:]}\n")
    if result.timed_out:
        pytest.fail(f"timed out after {timeout}s (hang): {' '.join(map(str, command))}\n{result.output[-4000:]}")
    return Run(result.returncode, result.output, result.seconds)


def _env(env):
    return {**os.environ, **QUIET_ENV, **(env or {})}


def _script(script):
    return str(WORKERS / script)


def run_workers(script, np_=2, args=(), timeout=240, env=None):
    """Run `tests/workers/<script>` (or a path) on `np_` workers under horovodrun (Gloo, localhost)."""
    return run_command(["python", _script(script), *map(str, args)], np_, timeout, env)


def run_command(command, np_=2, timeout=240, env=None):
    """Run `command` (a leading "python" is this Python) on `np_` workers under horovodrun."""
    command = [sys.executable if c == "python" and i == 0 else str(c) for i, c in enumerate(command)]
    return _finish(launch(command, np_, use_horovodrun=True, timeout=timeout, env=_env(env), sink=None),
                   command, timeout)


def run_elastic(script, np_, min_np, max_np, discovery, args=(), timeout=300, env=None):
    """Run `tests/workers/<script>` under horovodrun's elastic mode with discovery script `discovery`."""
    command = [sys.executable, _script(script), *map(str, args)]
    elastic = ["--min-np", str(min_np), "--max-np", str(max_np), "--host-discovery-script", _script(discovery)]
    return _finish(launch(command, np_, use_horovodrun=True, hosts=False, horovodrun_args=elastic,
                          timeout=timeout, env=_env(env), sink=None), command, timeout)


def run_plain(script, args=(), timeout=240, env=None):
    """Run `tests/workers/<script>` (or a path) as one plain process (no horovodrun)."""
    command = [sys.executable, _script(script), *map(str, args)]
    return _finish(run_process(command, timeout, _env(env)), command, timeout)


def run_script(script, nworkers, args=(), timeout=240, env=None):
    """Run `script` on `nworkers` under horovodrun, or as one plain process when 1."""
    if nworkers > 1:
        return run_workers(script, nworkers, args, timeout, env)
    return run_plain(script, args, timeout, env)


def readme_command(section, marker):
    """The first `horovodrun` line after `marker` in the README section titled `section`."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    part = text[text.index(f"## {section}"):]
    part = part[part.index(marker):]
    return re.search(r"^(horovodrun .*)$", part, re.M).group(1).strip()


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


@pytest.fixture(scope="session")
def mlp_reference(tmp_path_factory):
    """One plain process (`tests/workers/balance.py`): the MLP on digits, 2 epochs of 23 steps at
    global batch 64. The trajectory that uneven shares and gradient buckets must follow."""
    out = tmp_path_factory.mktemp("mlp-reference")
    assert_ok(run_plain("balance.py", ["--out", out, "--model", "mlp", "--epochs", "2"], timeout=240))
    return json.loads((out / "rank0.json").read_text())
