"""`tfdp.AutoStrategy`: measure the first steps, then exchange gradients the way that is fastest here.

It sits with the presets (it picks among them, with the advisor's cost model), above the
strategies it is built from.

Preset ``auto`` (``TFDP_STRATEGY=auto``). For its first `measure_steps` training steps it is
`tfdp.MirroredStrategy`; then, on every rank at the same step, it measures

- the step time of those synchronous steps (compute plus one all-reduce, which do not overlap),
- the time of an all-reduce of the model's gradients' size (at least 1 MB, at most 8 MB) and
  of one of 4 bytes (the link's bandwidth and latency, as this job sees them),
- each candidate's own compression compute on the model's shapes (`tfdp.tools.codec_timing`),

takes the largest value of each across ranks (so every rank holds the same numbers), predicts
every candidate's step with the advisor's cost model (`tfdp.tools.advisor`) and keeps sync
unless another candidate is predicted at least `BEATS_SYNC_BY` (20%) faster. Rank 0's pick is broadcast, rank 0
prints it and why, and the next step runs it. The candidates (`default_candidates`) are sync and
the compressed presets that stayed within 1 pp of sync in every cell of the preset grid
(benchmarks/results/preset_grid.md, summarised in `tfdp.presets.accuracy`): today fp16, bf16,
qsgd, topk-1pct, efsign and powersgd-r4. The asynchronous presets are not candidates: they
change when the workers wait, which the cost model of one synchronous step does not predict.

The pick is saved in checkpoints with the reducer state; a resumed job runs it from its first
step (see `tfdp.reducers.SwitchingReducer`).
"""

import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfdp import presets
from tfdp.comm.timing import allreduce_seconds
from tfdp.reducers import DEFAULT_MIN_COMPRESS_BYTES, AllReduceGradients, compressed_reducer_factory
from tfdp.reducers.switching import SwitchingReducer
from tfdp.strategies.base import HorovodStrategy
from tfdp.tools import advisor



def default_candidates():
    """Sync, then every compressed preset the preset grid measured within its band everywhere."""
    held = []
    for name in presets.preset_names():
        measured = presets.accuracy(name)
        if (presets.load_preset(name)["strategy"] == "compressed" and measured
                and measured["within_band"] == measured["cells"]):
            held.append(name)
    return ["sync", *held]

# The bandwidth probe: the model's gradients, but at least 1 MB (below that latency dominates).
PROBE_BYTES = (1 << 20, 8 << 20)
_REDUCER_OPTIONS = ("compressor", "error_feedback", "warmup_steps", "min_compress_bytes", "momentum_correction",
                    "local_residual")


def reducer_factory(preset, warmup=True):
    """``(communicator, state=None) -> reducer`` of preset `preset` (sync or a compressed preset);
    ``warmup=False`` leaves out its dense warm-up steps."""
    spec = presets.load_variant(preset)
    options = spec["options"]
    if spec["strategy"] == "mirrored" and not options:
        return lambda communicator, state=None: AllReduceGradients(communicator, op="sum", state=state)
    extra = sorted(set(options) - set(_REDUCER_OPTIONS))
    if spec["strategy"] != "compressed" or extra:
        raise ValueError(
            f"`candidates`: {preset!r} cannot be picked by auto (it is a {spec['strategy']} preset"
            f"{' with options ' + str(extra) if extra else ''}); auto chooses among sync and compressed presets.")
    return compressed_reducer_factory(
        options.get("compressor", "fp16"), options.get("error_feedback", True),
        options.get("warmup_steps", 0) if warmup else 0, options.get("min_compress_bytes", DEFAULT_MIN_COMPRESS_BYTES),
        op="sum",
        momentum_correction=options.get("momentum_correction", "auto"),
        local_residual=options.get("local_residual", False))


#: How much faster than sync's measured step a candidate must be predicted to replace it. Sync's
#: buckets hide part of its all-reduce behind backprop, which the cost model's C + M does not
#: know: the compute derived from sync's step is short by what they hid, and every candidate's
#: prediction with it (stop 36, the CNN on 2 hosts at 1000 Mbit/s: sync ran at 0.80x its C + M;
#: PowerSGD, predicted 16% faster than sync, ran 21% slower).
BEATS_SYNC_BY = 0.20


def pick(shapes, workers, step_seconds, probe_bytes, probe_seconds, latency_seconds, compressor_seconds,
         candidates=None):
    """The preset to run and the predictions behind it, from measurements of synchronous steps.

    Args:
        shapes: the trainable variables' shapes.
        workers: the number of workers.
        step_seconds: a synchronous step (compute, then one all-reduce of every gradient).
        probe_bytes, probe_seconds: an all-reduce of that many bytes took that long.
        latency_seconds: an all-reduce of 4 bytes took that long.
        compressor_seconds: dict preset -> compression compute per step (missing: 0).
        candidates: preset names to choose among (default: `default_candidates`).

    Returns:
        ``(name, rows, measured)``: the pick, the advisor's predictions fastest first, and the
        derived bandwidth (bytes/s) and compute (s) as a dict.

    Example:
        >>> pick([(784, 4096), (4096, 10)], 2, 1.5, 8e6, 0.6, 1e-3, {"powersgd-r4": 0.05})[0]
        'powersgd-r4'
    """
    sent = advisor.ring_bytes(probe_bytes, workers, "allreduce")
    bandwidth = sent / max(probe_seconds - latency_seconds, 1e-6)
    sync = advisor.predict("sync", shapes, workers, bandwidth, 0.0, latency_seconds)
    # Measured steps can come out below the predicted all-reduce (noise): keep some compute.
    compute = max(step_seconds - sync.communication_seconds, 0.1 * step_seconds)
    rows = advisor.advise(shapes, workers, bandwidth, compute, latency_seconds,
                          names=list(candidates or default_candidates()),
                          compressor_seconds=compressor_seconds)
    name = advisor.recommendation(rows, margin=BEATS_SYNC_BY)
    return name, rows, {"bandwidth_bytes": bandwidth, "compute_seconds": compute}


class AutoStrategy(HorovodStrategy):
    """Synchronous data parallelism that picks its gradient exchange after measuring this job.

    Args:
        candidates: preset names to choose among (sync and compressed presets); default
            `default_candidates()`, the presets that kept accuracy everywhere on the preset grid.
        measure_steps: synchronous steps before the pick (the first two, which trace the
            step, are not timed).
        global_step_logs: as in `tfdp.MirroredStrategy`.

    Example:
        >>> strategy = tfdp.AutoStrategy()        # or tfdp.strategy("auto")
        >>> with strategy.scope():
        ...     model = build_and_compile_model()
        >>> model.fit(x, y, batch_size=64)       # prints "tfdp auto: picked ..." on rank 0
        >>> strategy.auto_stats()["picked"]
    """

    def __init__(self, candidates=None, measure_steps=10, global_step_logs=True):
        candidates = default_candidates() if candidates is None else candidates
        if isinstance(candidates, str) or not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"`candidates` must be a list of distinct preset names. Received: candidates={candidates!r}")
        if not isinstance(measure_steps, int) or isinstance(measure_steps, bool) or measure_steps < 4:
            raise ValueError(f"`measure_steps` must be an integer >= 4. Received: measure_steps={measure_steps!r}")
        names = ["sync"] + [c for c in candidates if c != "sync"]  # measured under sync
        factories = {name: reducer_factory(name) for name in names}
        self.candidates = list(candidates)
        self.measure_steps = measure_steps
        self._measurements = None
        super().__init__(lambda communicator: SwitchingReducer(communicator, factories),
                         global_step_logs=global_step_logs)

    def training_callbacks(self, model=None, callbacks=()):
        return [*super().training_callbacks(model, callbacks), PickPreset(self)]

    def settling_steps(self):
        """Steps before the picked exchange runs in its steady state (measuring, then its warm-up)."""
        warmups = [presets.load_variant(c)["options"].get("warmup_steps", 0) for c in self.candidates]
        return self.measure_steps + max(warmups)

    def auto_stats(self):
        """The pick and what it was based on; None before it is made.

        Returns:
            dict with ``picked``, and when measured in this process ``step_ms``,
            ``compute_ms``, ``bandwidth_mbit``, ``latency_ms``, ``compressor_ms`` and
            ``predicted_ms`` (per candidate); ``from_checkpoint`` when the pick was loaded.
        """
        decided = self.gradient_reducer.decided
        if decided is None:
            return None
        return {"picked": decided, **(self._measurements or {"from_checkpoint": True})}

    def decide(self, model, step_seconds):
        """Measure, pick and switch on every rank (a collective); return the pick."""
        communicator = self.extended.communicator
        shapes = [tuple(v.shape) for v in model.trainable_variables]
        elements = int(np.clip(sum(int(np.prod(s)) for s in shapes), PROBE_BYTES[0] // 4, PROBE_BYTES[1] // 4))
        probe = allreduce_seconds(communicator, elements)
        latency = allreduce_seconds(communicator, 1)
        from tfdp.tools.codec_timing import compressor_seconds

        compressors = [c for c in self.candidates if presets.load_variant(c)["strategy"] == "compressed"]
        measured = [step_seconds, probe, latency] + [compressor_seconds(c, shapes, repeats=3) for c in compressors]
        # The slowest rank's numbers, the same on every rank.
        slowest = communicator.allreduce([tf.constant(measured, tf.float64)], op="max")[0].numpy().tolist()
        step_seconds, probe, latency, *compress = slowest
        compress = dict(zip(compressors, compress))
        name, rows, derived = pick(shapes, communicator.size, step_seconds, 4 * elements, probe, latency, compress,
                                   self.candidates)
        index = self.gradient_reducer.names.index(name)
        name = self.gradient_reducer.names[int(communicator.broadcast(tf.constant([index]), root_rank=0).numpy()[0])]
        self.gradient_reducer.switch_to(name)
        self._measurements = {
            "step_ms": 1e3 * step_seconds, "compute_ms": 1e3 * derived["compute_seconds"],
            "bandwidth_mbit": 8e-6 * derived["bandwidth_bytes"], "latency_ms": 1e3 * latency,
            "compressor_ms": {c: 1e3 * s for c, s in compress.items()},
            "predicted_ms": {r.preset: 1e3 * r.seconds_per_step for r in rows}}
        if self.is_chief:
            print(_explain(name, self._measurements), flush=True)
        return name


def _explain(name, m):
    predicted = ", ".join(f"{p} {ms:.1f}" for p, ms in sorted(m["predicted_ms"].items(), key=lambda kv: kv[1]))
    if name == "sync":
        why = f"nothing is predicted {BEATS_SYNC_BY:.0%} faster than sync"
    elif "sync" in m["predicted_ms"]:
        why = f"predicted {m['predicted_ms'][name]:.1f} ms/step against sync's {m['predicted_ms']['sync']:.1f}"
    else:
        why = f"the fastest of the candidates, predicted {m['predicted_ms'][name]:.1f} ms/step"
    return (f"tfdp auto: picked {name}: {why}. Measured over the synchronous steps: {m['step_ms']:.1f} ms/step, "
            f"{m['compute_ms']:.1f} ms of it compute; the link {m['bandwidth_mbit']:.0f} Mbit/s, "
            f"{m['latency_ms']:.2f} ms per collective. Predicted ms/step: {predicted}.")


class PickPreset(keras.callbacks.Callback):
    """Times the synchronous steps, then has the strategy pick (or runs a pick loaded from a checkpoint)."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self._steps, self._started = 0, None
        self._seconds = []

    def _rebuild(self):
        self.model.make_train_function(force=True)  # the next step traces the picked exchange

    def on_train_begin(self, logs=None):
        reducer = self.strategy.gradient_reducer
        decided = reducer.decided  # a checkpoint loaded before fit (load_weights) may hold one
        if decided is not None and decided != reducer.current_name:
            reducer.switch_to(decided)
            self._rebuild()

    def on_train_batch_begin(self, batch, logs=None):
        reducer = self.strategy.gradient_reducer
        decided = reducer.decided  # BackupAndRestore loads in on_train_begin, after this callback's
        if decided is not None and decided != reducer.current_name:
            reducer.switch_to(decided)
            self._rebuild()
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.strategy.gradient_reducer.decided is not None:
            return
        self._steps += 1
        if self._steps > 2:  # the first steps trace the function
            self._seconds.append(time.perf_counter() - self._started)
        if self._steps >= self.strategy.measure_steps:
            self.strategy.decide(self.model, statistics.median(self._seconds))
            self._rebuild()


__all__ = ["AutoStrategy", "PickPreset", "default_candidates", "pick", "reducer_factory"]
