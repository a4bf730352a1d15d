"""A pytest plugin that runs Keras's own tests inside a `tfdp.MirroredStrategy` scope.

Used by ``tests/test_keras_suite.py`` under horovodrun: every Keras test builds its models
under a fresh tfdp strategy (entered after Keras's own `setUp`, which resets the graph),
so Keras's expectations about `fit`/`evaluate`/`predict` are checked on 2 workers.

    horovodrun -np 2 -H localhost:2 --gloo python -m pytest -p tfdp_scope_plugin \\
        .../keras/src/trainers/trainer_test.py
"""

import sys
import types

import keras  # noqa: F401 - imported before the jax stub below, so Keras sees no jax
from keras.src.testing import test_case

import tfdp

# trainer_test.py imports jax at the top but uses it only on the jax backend.
sys.modules.setdefault("jax", types.ModuleType("jax"))

_set_up, _tear_down = test_case.TestCase.setUp, test_case.TestCase.tearDown


def setUp(self):  # noqa: N802 - unittest's name
    _set_up(self)
    self._tfdp_scope = tfdp.MirroredStrategy().scope()
    self._tfdp_scope.__enter__()


def tearDown(self):  # noqa: N802
    self._tfdp_scope.__exit__(None, None, None)
    _tear_down(self)


test_case.TestCase.setUp, test_case.TestCase.tearDown = setUp, tearDown


def pytest_runtest_logreport(report):
    """With TFDP_KERAS_SUITE_OUT set, append each test's outcome and error line to <out>/rank<r>.jsonl."""
    import json
    import os

    out = os.environ.get("TFDP_KERAS_SUITE_OUT")
    if not out or (report.when != "call" and report.outcome != "failed" and not report.skipped):
        return
    error = ""
    if report.failed:
        lines = [line for line in str(report.longrepr).splitlines() if line.startswith("E ")]
        error = lines[0][1:].strip() if lines else str(report.longrepr).splitlines()[-1]
    record = {"test": report.nodeid.split("::")[-1], "outcome": report.outcome, "error": error}
    with open(os.path.join(out, f"rank{os.environ.get('HOROVOD_RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
