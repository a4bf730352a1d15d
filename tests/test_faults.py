"""Bad input and dead workers end the job quickly with a clear error on every rank."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import QUIET_ENV, run_workers

pytestmark = pytest.mark.multiprocess

# Wall-clock bound for the whole job, TensorFlow start-up (~10 s on 2 cores) included.
BOUND_SECONDS = 90


BAD_INPUT = {
    "different-model": "the model differs across workers",
    "extra-layer": "the model differs across workers",
    "built-outside": "was built outside the scope of its tfdp strategy, so its weights differ between the workers",
    "jit": "Pass jit_compile=False",
    "optimizer-outside": "the optimizer SGD was created outside the scope of the model's MirroredStrategy",
    "tiny-batch": "The global batch size 1 is smaller than the number of workers (2)",
    "input-dtype": "The workers' inputs differ in shape or dtype: ranks [1] do not match rank 0",
    "input-shape": "The workers' inputs differ in shape or dtype: ranks [1] do not match rank 0",
}


@pytest.fixture(scope="module")
def survived(tmp_path_factory):
    """The faults a job survives, one script after another in one 2-worker job (one TensorFlow
    start for all): bad input, uneven inputs, non-finite gradients, data already split per rank,
    datasets shuffled differently on each rank, callbacks that stop training on one rank, a model
    trained outside the scope."""
    out = tmp_path_factory.mktemp("survived")
    for folder in ("uneven", "nonfinite", "cache"):
        (out / folder).mkdir()
    run = run_workers("in_sequence.py", 2, ["faults.py", "--cases", *BAD_INPUT, "--", "uneven.py", "--out",
                                            out / "uneven", "--", "nonfinite.py", "--out", out / "nonfinite",
                                            "--", "split_inputs.py", "--", "shuffled_datasets.py", "--folder",
                                            out / "cache", "--",
                                            "rank_local_stop.py", "--", "outside_scope.py"],
                      timeout=2 * BOUND_SECONDS)
    assert run.returncode == 0, run.output[-4000:]
    return run, out


def section(output, script, rank):
    """Rank `rank`'s stderr lines while `in_sequence.py` ran `script`."""
    lines = [line.split(":", 1)[1] for line in output.splitlines() if line.startswith(f"[{rank}]<stderr>:")]
    start = lines.index(f"in_sequence: {script}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("in_sequence: ")), len(lines))
    return lines[start:end]


def marked(output, script, rank, needle):
    """`section`'s lines, where each "case: NAME" marker stands (NAME -> index), and the indices of
    the lines holding `needle`."""
    lines = section(output, script, rank)
    cases = {line[len("case: "):]: i for i, line in enumerate(lines) if line.startswith("case: ")}
    return lines, cases, [i for i, line in enumerate(lines) if needle in line]


def test_bad_input_is_a_value_error_on_every_rank_within_seconds(survived):
    # All cases in one job: each raises on both ranks at the same collective, so the next
    # case starts paired. The worker exits non-zero if a case does not raise.
    run, _ = survived
    for case, message in BAD_INPUT.items():
        for rank in (0, 1):
            [line] = [line for line in run.output.splitlines() if line.startswith(f"[{rank}]<stderr>:case {case}:")]
            assert message in line, line
            assert float(line.split(": ")[1].split(" s")[0]) < 10, line  # seconds from the case's start


@pytest.mark.full
@pytest.mark.parametrize("case", ["different-model", "input-shape"])
def test_bad_input_ends_the_job_when_not_caught(case):
    run = run_workers("faults.py", 2, ["--case", case], timeout=BOUND_SECONDS)
    assert run.returncode != 0
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]<stderr>:") and BAD_INPUT[case] in line
                   for line in run.output.splitlines()), f"rank {rank} did not report:\n{run.output[-4000:]}"


def test_killed_worker_ends_the_job():
    run = run_workers("faults.py", 2, ["--case", "die"], timeout=BOUND_SECONDS)
    assert run.returncode != 0
    # horovodrun names the first rank to fail (SIGKILL = 137) and then ends the others; rank 0's own
    # "exit with status code" line is racy (the launcher may exit before printing it), so it is not asserted.
    assert "The first process to do so was:\nProcess name: 1\nExit code: 137" in run.output, run.output[-3000:]
    assert run.seconds < BOUND_SECONDS


def test_stalled_worker_ends_the_job_within_the_step_timeout():
    # Rank 1 sleeps inside fit without exiting; rank 0 waits in an all-reduce that never
    # completes. tfdp's step watchdog (10 s here, 120 s by default) ends rank 0; horovodrun
    # then ends rank 1.
    run = run_workers("faults.py", 2, ["--case", "stall"], timeout=BOUND_SECONDS,
                      env={"TFDP_STEP_TIMEOUT_SECONDS": "10"})
    assert run.returncode != 0
    # Whichever watchdog fires first (rank 0 waiting in batch 4, or rank 1 stuck in batch 3's
    # callbacks) exits with 75 and names the batch; the launcher ends the other rank.
    assert re.search(r"tfdp: rank [01]: training batch [34] has not finished after 10 s", run.output), \
        run.output[-3000:]
    assert "Exit code: 75" in run.output
    assert run.seconds < 60


@pytest.mark.full
def test_bad_step_timeout_is_an_error_on_every_rank():
    run = run_workers("faults.py", 2, ["--case", "stall"], timeout=BOUND_SECONDS,
                      env={"TFDP_STEP_TIMEOUT_SECONDS": "soon"})
    assert run.returncode != 0
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]<stderr>:") and "TFDP_STEP_TIMEOUT_SECONDS must be a number" in line
                   for line in run.output.splitlines()), run.output[-3000:]


def test_missing_horovod_says_how_to_install(tmp_path):
    # A `horovod` package that fails to import stands in for a missing installation.
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("raise ImportError('no horovod here')\n")
    code = "import tfdp\ntry:\n    tfdp.MirroredStrategy()\nexcept ImportError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **QUIET_ENV, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tools/setup_env.sh" in out.stdout and "no horovod here" in out.stdout


def _max_relative_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / (np.abs(np.asarray(y)) + 1e-12)))
               for x, y in zip(a, b))


def test_nonfinite_gradients_skip_the_step_on_every_rank(survived):
    run, out = survived
    ranks = run.results(out / "nonfinite", 2)
    skip = [r["skip"] for r in ranks]
    # Only rank 1 saw NaN inputs, once per epoch; both ranks skipped those 2 of 16 steps.
    assert [r["skipped"] for r in skip] == [2, 2]
    assert skip[0]["weights"] == skip[1]["weights"]
    # Skipping changed nothing else: plain Keras trained without that batch ends at the same weights.
    assert _max_relative_difference(skip[0]["weights"], skip[0]["reference"]) <= 1e-5
    # Negative control: without the option one NaN reaches every rank's weights.
    assert all(np.isnan(np.ravel(r["plain"]["weights"][0])).all() for r in ranks)


def test_data_already_split_per_rank_is_warned_on_every_rank(survived):
    run, _ = survived
    for rank in (0, 1):
        lines, cases, warnings = marked(run.output, "split_inputs.py", rank, "hold other rows than rank 0's")
        # Negative controls: whole data on every rank (arrays: fit and evaluate; tf.data) says nothing.
        assert len(warnings) == 2, lines
        assert cases["split per rank"] < warnings[0] < cases["whole tf.data"], lines
        assert cases["tf.data sharded per rank"] < warnings[1] < cases["done"], lines
        assert "x[rank::size]" in lines[warnings[0]] and f"this is rank {rank}" in lines[warnings[0]]


def test_datasets_shuffled_differently_on_each_rank_are_warned_on_every_rank(survived):
    run, _ = survived
    for rank in (0, 1):
        lines, cases, warnings = marked(run.output, "shuffled_datasets.py", rank, "tfdp: warning: the tf.data pipeline")
        # Negative controls: a seeded shuffle, and an unseeded one built after the strategy, say nothing.
        # Seeds that differ between ranks and a shuffle without any seed are warned about once each.
        assert len(warnings) == 3, lines
        assert cases["seeds differ"] < warnings[0] < cases["seeds differ again"], lines
        assert cases["unseeded"] < warnings[1] < cases["custom loop, unseeded"], lines
        # A custom loop's `experimental_distribute_dataset` is checked too.
        assert cases["custom loop, unseeded"] < warnings[2] < cases["cached, built after the strategy"], lines
        assert "ranks [1] shuffles with other seeds than rank 0's" in lines[warnings[0]]
        assert "ranks [0, 1] shuffles without a seed" in lines[warnings[1]]
        assert f"this is rank {rank}" in lines[warnings[1]] and "seed=" in lines[warnings[1]]


def test_datasets_cached_to_a_file_get_a_file_per_rank_or_are_refused(survived):
    run, out = survived
    # Built after the strategy: rank 0 writes the file asked for, rank 1 its own; both complete.
    assert sorted((out / "cache").iterdir()) == sorted(out / "cache" / f"after{suffix}.{part}"
                                                       for suffix in ("", ".rank1")
                                                       for part in ("index", "data-00000-of-00001"))
    for rank in (0, 1):
        lines = section(run.output, "shuffled_datasets.py", rank)
        start = lines.index("case: cached, built before the strategy")
        # Built before it: one file for both ranks, refused before anything is written.
        refused = [line for line in lines[start:] if line.startswith("refused: ")]
        assert len(refused) == 1 and "The tf.data pipelines of ranks [0, 1] cache to one file" in refused[0], lines
        assert "before'" in refused[0] and f"this is rank {rank}" in refused[0]


def test_a_callback_that_stops_one_rank_stops_every_rank_there(survived):
    run, _ = survived
    stopped = {}
    for rank in (0, 1):
        lines = section(run.output, "rank_local_stop.py", rank)
        case = None
        for line in lines:
            if line.startswith("case: "):
                case = line[len("case: "):]
            elif line.startswith("stopped: ") or line.startswith("tfdp: rank"):
                stopped.setdefault((rank, case), []).append(line)
    # 4 batches an epoch. Before tfdp agreed, the other rank waited in its next step until the
    # step watchdog ended the job (120 s).
    for case, iterations, asked in (("batch on rank 1", 3, 1), ("epoch on rank 0", 8, 0), ("lambda on rank 1", 2, 1),
                                    ("every rank", 3, None)):
        results = [stopped[(rank, case)][-1] for rank in (0, 1)]
        assert results[0] == results[1] and f"iterations={iterations} " in results[0], (case, results)
        for rank in (0, 1):
            told = [line for line in stopped[(rank, case)] if line.startswith("tfdp: rank")]
            # Only the ranks that did not ask are told; where every rank asked, nobody is.
            assert len(told) == (asked is not None and rank != asked), (case, rank, told)
            if told:
                assert f"model.stop_training on rank(s) [{asked}]" in told[0]


def test_a_model_trained_outside_the_scope_is_warned_about_once_on_every_rank(survived):
    run, _ = survived
    for rank in (0, 1):
        lines, cases, warned = marked(run.output, "outside_scope.py", rank, "trains it on each of the 2 workers alone")
        # Negative controls: the model of the scope, a second fit of the same model, and a model with
        # its own train_step say nothing.
        assert len(warned) == 1 and cases["alone"] < warned[0] < cases["alone again"], lines


def test_uneven_inputs_end_every_rank_at_the_same_step(survived):
    run, out = survived
    ranks = run.results(out / "uneven", 2)
    # 8 global batches on rank 0, 10 on rank 1: both train 8 per epoch, 3 epochs.
    assert [r["iterations"] for r in ranks] == [24, 24]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert any("rank 1 drops its last 2 every epoch" in line for line in section(run.output, "uneven.py", 1))
