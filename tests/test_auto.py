"""`tfdp.AutoStrategy` (preset ``auto``): the pick from measurements, the switch, a 2-worker job."""

import json

import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_ok, run_workers

from tfdp.auto import default_candidates, pick, reducer_factory
from tfdp.comm.fake import run_ranks
from tfdp.reducers.switching import SwitchingReducer

# The 6 M-parameter MLP of `tfdp bench` (784 -> 4096 -> 1024 ... as the advisor's stand-in).
SHAPES = [(784, 4096), (4096,), (4096, 1024), (1024,), (1024, 10), (10,)]
MB = 1 << 20


def test_a_slow_link_picks_compression_and_a_fast_one_keeps_sync():
    # 100 Mbit/s: an 8 MB all-reduce between 2 workers sends 8 MB, 0.67 s; a 1.6 s step is mostly that.
    slow, rows, measured = pick(SHAPES, 2, step_seconds=1.6, probe_bytes=8 * MB, probe_seconds=0.67,
                                latency_seconds=1e-3, compressor_seconds={"powersgd-r4": 0.03, "qsgd": 0.2})
    assert slow == "powersgd-r4" and rows[0].preset == "powersgd-r4"
    assert 90 < 8e-6 * measured["bandwidth_bytes"] < 110
    # Loopback: the all-reduce is a few ms of a compute-bound step; compression only adds compute.
    fast, rows, _ = pick(SHAPES, 2, step_seconds=0.2, probe_bytes=8 * MB, probe_seconds=0.004, latency_seconds=1e-4,
                         compressor_seconds={"powersgd-r4": 0.03, "qsgd": 0.02, "fp16": 0.004, "bf16": 0.004,
                                             "topk-1pct": 0.02, "efsign": 0.02})
    assert fast == "sync"
    # A candidate predicted faster by less than 20% does not replace sync (sync's buckets may have
    # hidden that much of its all-reduce). 250 MB/s: sync's 24 MB take 96 ms of a 300 ms step, fp16
    # saves 48 ms of them, 16%; at 200 MB/s it saves 60 ms of a 300 ms step, 20%, and replaces sync.
    for probe_seconds, expected in ((0.0337, "sync"), (0.0421, "fp16")):
        picked, rows, _ = pick(SHAPES, 2, step_seconds=0.3, probe_bytes=8 * MB, probe_seconds=probe_seconds,
                               latency_seconds=1e-4, compressor_seconds={"fp16": 0.0}, candidates=["sync", "fp16"])
        predicted = {r.preset: r.seconds_per_step for r in rows}
        assert picked == expected, (predicted, probe_seconds)


def test_the_candidates_are_sync_and_the_compressed_presets_that_held_accuracy_everywhere(monkeypatch):
    # strategies/accuracy.json, from the preset grid: every compressed preset held all 24 cells.
    assert default_candidates() == ["sync", "bf16", "efsign", "fp16", "powersgd-r4", "qsgd", "topk-1pct"]
    from tfdp import presets
    assert presets.accuracy("sync") is None  # the reference itself
    # A compressed preset that missed one cell is no candidate (as top-k was, at 16 of 24).
    measured = presets.accuracy
    monkeypatch.setattr(presets, "accuracy", lambda name: dict(measured(name), within_band=23)
                        if name == "topk-1pct" else measured(name))
    assert "topk-1pct" not in default_candidates() and "efsign" in default_candidates()


def test_only_sync_and_compressed_presets_can_be_candidates():
    for bad in ("async-s1", "balanced", "zero1", "local-sgd-h16"):
        with pytest.raises(ValueError, match=f"{bad}.*cannot be picked by auto"):
            reducer_factory(bad)


def test_the_switch_hands_over_every_call_and_keeps_one_state():
    grads = [tf.constant(np.linspace(-1, 1, 64 * 64, dtype="float32").reshape(64, 64))]

    def body(comm):
        variables = [tf.Variable(tf.zeros([64, 64]), name="kernel")]
        reducer = SwitchingReducer(comm, {name: reducer_factory(name) for name in ("sync", "fp16")})
        assert reducer.decided is None and reducer.current_name == "sync"
        dense = comm.stats.as_dict()["gradient_bytes"]
        reducer.reduce(grads, variables)
        after_sync = comm.stats.as_dict()["gradient_bytes"]
        reducer.switch_to("fp16")
        [summed] = reducer.reduce(grads, variables)
        keys = [key for key in reducer.state._entries]
        return (after_sync - dense, comm.stats.as_dict()["gradient_bytes"] - after_sync, summed.numpy(),
                reducer.decided, keys)

    for sync_bytes, fp16_bytes, summed, decided, keys in run_ranks(2, body):
        assert sync_bytes == 64 * 64 * 4 and fp16_bytes == 64 * 64 * 2
        np.testing.assert_allclose(summed, 2 * grads[0].numpy(), rtol=1e-3)
        assert decided == "fp16"
        assert keys[0] == "auto/choice" and "compression_step" in keys  # the chosen reducer's state is shared


@pytest.mark.multiprocess
def test_auto_on_two_workers_picks_the_same_preset_everywhere_and_trains_on(tmp_path):
    run = run_workers("auto.py", 2, ["--out", tmp_path], timeout=240)
    assert_ok(run)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for case in ("default", "forced"):
        first, second = (r[case] for r in ranks)
        assert first["stats"] == second["stats"] and first["weights"] == second["weights"]
        assert first["loss_fell"]
    # Loopback: the all-reduce costs next to nothing, no candidate beats sync by 20%.
    assert ranks[0]["default"]["stats"]["picked"] == "sync"
    # Only PowerSGD to choose from: after the 6 measured steps (and its 20 dense warm-up steps)
    # the gradients travel as PowerSGD's factors.
    forced = ranks[0]["forced"]
    assert forced["stats"]["picked"] == "powersgd-r4"
    assert forced["last_step_gradient_bytes"] < forced["dense_gradient_bytes"] / 4
    announced = [line for line in run.output.splitlines() if "tfdp auto: picked" in line]
    assert len(announced) == 2 and all(line.startswith("[0]<stdout>") for line in announced), announced
