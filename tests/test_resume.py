"""Kill and resume: a run whose worker is SIGKILLed and that resumes from BackupAndRestore ends
where an uninterrupted run ends, for presets with reducer state too.

Digits, 2 workers, 6 epochs, momentum SGD, shuffle=False. Rank 1 is SIGKILLed in epoch 3;
the same command run again resumes from the checkpoint rank 0 wrote after epoch 2, which
holds the reducer state (error-feedback residuals of both ranks, PowerSGD's Q, step
counters, local-SGD anchors; stale gradients were applied before it was written). Each
preset also has a negative control: the same resume with its reducer state dropped (or,
for sync, which has none, with the saved epoch forgotten) ends measurably elsewhere.
"""

import json
import shutil

import numpy as np
import pytest
from conftest import run_workers

pytestmark = pytest.mark.multiprocess
BOUND_SECONDS = 120
PARITY = 1e-6
CONTROL = 1e-4
# The quick tier resumes the preset with the most reducer state; the full tier all of them.
# "@adam": under Adam, top-k compresses each worker's own optimizer step, so every rank's
# Adam moments are state too; zero1 keeps each rank's shard of Adam's moments. auto picks (here
# among PowerSGD alone) at step 10 of epoch 0: its pick and PowerSGD's state are in the checkpoint.
# "@multi": a MultiOptimizer, Adam (update compression, per-rank moments) for the conv layer and
# momentum SGD (momentum correction) for the rest, sharing one reducer with a step counter each.
PRESETS = [pytest.param("topk-1pct"),
           *(pytest.param(p, marks=pytest.mark.full)
             for p in ("sync", "powersgd-r4", "async-s1", "local-sgd-h16", "topk-1pct@adam", "topk-1pct@multi", "qsgd@multi", "zero1@adam",
                       "auto:candidates=[powersgd-r4]"))]


def max_relative_difference(a, b):
    """Per tensor max |a - b| / max |b|, the largest over tensors."""
    return max(float(np.max(np.abs(np.subtract(x, y))) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b))


def arguments(tmp_path, preset, name, backup, *extra):
    """`resume.py`'s arguments for the run `name`, whose output folder this makes."""
    (tmp_path / name).mkdir()
    preset, _, optimizer = preset.partition("@")
    return ["--preset", preset, "--optimizer", optimizer or "sgd", "--out", tmp_path / name,
            "--backup", tmp_path / backup, *extra]


def result(tmp_path, name):
    path = tmp_path / name / "rank0.json"
    return json.loads(path.read_text()) if path.exists() else None


def job(tmp_path, preset, name, backup, *extra):
    run = run_workers("resume.py", 2, arguments(tmp_path, preset, name, backup, *extra), timeout=BOUND_SECONDS)
    return run, result(tmp_path, name)


def resumed_control_and_uninterrupted(tmp_path, preset, control_backup, *control_extra):
    """The resume, its negative control and the uninterrupted run, one after the other in one job
    (one TensorFlow start)."""
    run = run_workers("in_sequence.py", 2, ["resume.py", *arguments(tmp_path, preset, "resumed", "backup"), "--",
                                            "resume.py", *arguments(tmp_path, preset, "control", control_backup,
                                                                    *control_extra), "--",
                                            "resume.py", *arguments(tmp_path, preset, "full", "backup-full")],
                      timeout=3 * BOUND_SECONDS)
    return run, result(tmp_path, "resumed"), result(tmp_path, "control"), result(tmp_path, "full")


@pytest.mark.parametrize("preset", PRESETS)
def test_kill_and_resume_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, preset):
    killed, _ = job(tmp_path, preset, "killed", "backup", "--die-at-epoch", 3)
    assert killed.returncode != 0 and "Process name: 1\nExit code: 137" in killed.output, killed.output[-3000:]
    # Rank 0 saved epochs 0-2 before rank 1 died in epoch 3; rank 1 never wrote.
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 3
    shutil.copytree(tmp_path / "backup", tmp_path / "backup-copy")

    # The resume (the same command, again), then the negative control from the copy of the backup.
    if preset == "sync":  # no reducer state: forget the saved epoch instead
        control = ("backup-copy", "--forget-epoch")
    elif preset.startswith("zero1"):  # its state is the optimizer's, sharded: zero the restored slots
        control = ("backup-copy", "--reset-optimizer-slots")
    elif preset.startswith("async-s"):  # its state is what is in flight: checkpoints written without settling
        job(tmp_path, preset, "killed-unsettled", "backup-unsettled", "--die-at-epoch", 3, "--drop-reducer-state")
        control = ("backup-unsettled", "--drop-reducer-state")
    else:
        control = ("backup-copy", "--drop-reducer-state")
    run, resumed_state, control_state, full_state = resumed_control_and_uninterrupted(tmp_path, preset, *control)
    assert run.returncode == 0, run.output[-3000:]
    assert (resumed_state["first_epoch"], resumed_state["epochs_trained"]) == (3, 3)
    assert resumed_state["iterations"] == full_state["iterations"]
    difference = max_relative_difference(resumed_state["weights"], full_state["weights"])
    print(f"\n{preset}: resumed vs uninterrupted {difference:.2e}; reducer state {full_state['state']}")
    assert difference <= PARITY

    dropped = max_relative_difference(control_state["weights"], full_state["weights"])
    print(f"{preset}: the same resume without its reducer state: {dropped:.2e}")
    assert dropped > CONTROL
