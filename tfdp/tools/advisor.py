"""Predict time per step of each preset from the model's shapes, the link and the compute time.

Cost model (steady state, P workers, link bandwidth B bytes/s, latency a per collective):

- ring all-reduce of b bytes: each worker sends 2 (P - 1) / P x b;
- ring all-gather of b bytes per worker: each worker sends (P - 1) x b;
- communication time M = bytes sent / B + a x collectives, where an all-gather of b bytes per
  worker counts its bytes `allgather_slowdown(b, B)` times: Horovod's Gloo all-gather moves its
  first S bytes at the wire's rate and the rest at half of it, S = max(0.13 MB, B x 15 ms) (as if
  what fits in the receiver's TCP window went both ways at once: 131,072 bytes by default here,
  grown by autotuning on faster links). Measured on 2 hosts (`benchmarks/collectives_on_link.py
  --sizes-mb`; all-gather time over ring wire time): 10 Mbit/s 1.06x at 0.1 MB, 1.45x at 0.2,
  1.77x at 0.4; 100 Mbit/s 1.05x at 0.1 MB, 1.63x at 0.5, 2.02x at 4; 1000 Mbit/s 1.03x at
  2 MB, 1.55x at 4 (an all-reduce 1.04-1.15x from 0.25 MB up). The workers are on separate hosts;
- synchronous and compressed presets: C + M; bounded staleness s >= 1: max(C, M);
  local SGD every H steps: C + M / H.
- workers of different speeds (relative speeds v_r, 1 = the worker C was measured on):
  equal shares wait for the slowest, C / min(v); ``balance`` presets split each batch by
  speed, C x P / sum(v).

Payload sizes come from the codecs themselves (`payload_bytes`), with the same rule as
`CompressedStrategy` for small tensors (sent dense below `min_compress_bytes`). A compressed
preset also computes: compressing, decompressing, keeping its residual. Given
``compressor_seconds`` (measured on the model's own shapes by `tfdp.tools.codec_timing`,
``tfdp advise --measure-compressors``), a compressed step is C + K + M; without it K is
left out and the prediction is a lower bound for compressed presets.

Example:
    >>> shapes = [(784, 4096), (4096,), (4096, 1024), (1024,)]
    >>> rows = advise(shapes, workers=2, bandwidth_bytes=100e6 / 8, compute_seconds=0.05)
    >>> rows[0].preset  # the fastest predicted preset
"""

from dataclasses import dataclass

from tfdp import presets
from tfdp.compression import resolve
from tfdp.compression.codecs import plain_rides
from tfdp.reducers import DEFAULT_MIN_COMPRESS_BYTES


ROW_COUNT_BYTES = 4
#: Seconds per collective when nothing was measured (`tfdp bench` and `auto` measure it: 1-4 ms for
#: an all-reduce of 4 bytes between emulated hosts here, Horovod's negotiation included).
DEFAULT_LATENCY_SECONDS = 1e-4
#: What of an all-gather moves at the wire's rate, per worker: at least these bytes, and at least
#: `ALLGATHER_OVERLAP_SECONDS` of the link's bytes; the rest takes twice as long (see above).
ALLGATHER_OVERLAP_BYTES = 1.3e5
ALLGATHER_OVERLAP_SECONDS = 0.015
#: Sync's all-reduce sends each rank's row count and its square (equal rows need no weighting).
EVEN_ROWS_BYTES = 8


@dataclass(frozen=True)
class Prediction:
    preset: str
    seconds_per_step: float
    communication_seconds: float
    bytes_sent: float  # per worker per step, on the wire
    payload_bytes: float  # per worker per step, handed to collectives


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def ring_bytes(payload, workers, kind):
    """Bytes each worker sends for one ring collective over `payload` bytes."""
    if workers < 2:
        return 0.0
    if kind == "allreduce":
        return 2.0 * (workers - 1) / workers * payload
    if kind == "allgather":
        return float((workers - 1) * payload)
    raise ValueError(f"`kind` must be 'allreduce' or 'allgather'. Received: kind={kind!r}")


def allgather_slowdown(payload, bandwidth_bytes):
    """Seconds an all-gather of `payload` bytes per worker takes per second its bytes need on a link
    of `bandwidth_bytes` bytes/s: 1 up to the overlap (see the module docstring), approaching 2 above.

    Example:
        >>> allgather_slowdown(1e5, 12.5e6), allgather_slowdown(3.75e5, 12.5e6), allgather_slowdown(4e6, 125e6)
        (1.0, 1.5, 1.53125)
    """
    overlap = max(ALLGATHER_OVERLAP_BYTES, ALLGATHER_OVERLAP_SECONDS * bandwidth_bytes)
    return 2.0 - min(1.0, overlap / payload) if payload > 0 else 1.0


def exchange(preset_options, kind, shapes, workers=2):
    """Return (payloads, collectives): [(bytes, "allreduce"|"allgather")] per exchange among `workers`, and its count.

    Each rank's row count (one float32) travels with the gradients of a Keras training step,
    except under error feedback, whose residuals must not change scale with a step's rows;
    sync's plain all-reduce sends the count and its square (`tfdp.reducers.base`).
    """
    plain_sum = kind == "mirrored" and not preset_options.get("balance") \
        and not preset_options.get("shard_optimizer_state")
    dense = sum(4 * _numel(s) for s in shapes) + (EVEN_ROWS_BYTES if plain_sum else ROW_COUNT_BYTES)
    if kind != "compressed":
        return [(dense, "allreduce")], 1
    codec = resolve(preset_options.get("compressor", "fp16"))
    limit = preset_options.get("min_compress_bytes", DEFAULT_MIN_COMPRESS_BYTES)
    rows = 0 if preset_options.get("error_feedback", True) else ROW_COUNT_BYTES
    small = sum(4 * _numel(s) for s in shapes if 4 * _numel(s) < limit) + rows
    large = [s for s in shapes if 4 * _numel(s) >= limit]
    compressed = sum(codec.payload_bytes(s) for s in large)
    travel = codec.travels_by(workers)
    rounds = codec.rounds
    if not large:
        return [(small, "allreduce")], 1
    # The small tensors ride in the codec's collective where they can, as in `CompressedGradients`.
    if small and not plain_rides(workers, small, travel == "allreduce", codec.payload_dtype == "float32"):
        return [(compressed, travel), (small, "allreduce")], rounds + 1
    return [(compressed, travel), (small, travel)], rounds


def compute_time(compute_seconds, speeds, balanced):
    """Compute time per step of a job whose workers run at relative `speeds` (None: all 1)."""
    if not speeds:
        return compute_seconds
    if balanced:
        return compute_seconds * len(speeds) / sum(speeds)
    return compute_seconds / min(speeds)


def predict(preset, shapes, workers, bandwidth_bytes, compute_seconds, latency_seconds=DEFAULT_LATENCY_SECONDS,
            speeds=None, compressor_seconds=0.0):
    """Predicted `Prediction` for the preset named `preset`; `speeds`: each worker's relative speed;
    `compressor_seconds`: the preset's measured compression compute per step (see the module docstring)."""
    spec = presets.load_variant(preset)
    options, kind = spec["options"], spec["strategy"]
    if speeds is not None and len(speeds) != workers:
        raise ValueError(f"`speeds` needs one relative speed per worker ({workers}). Received: {speeds!r}")
    compute_seconds = compute_time(compute_seconds, speeds, options.get("balance") is not None)
    if workers > 1 and kind == "compressed":
        compute_seconds += compressor_seconds
    payloads, collectives = exchange(options, kind, shapes, workers)
    sent = sum(ring_bytes(b, workers, how) for b, how in payloads)
    # The bytes' time on the link: an all-gather's count `allgather_slowdown` times, by the size of
    # the one all-gather that carries them all (what rides with a payload travels in its collective).
    gathered = sum(b for b, how in payloads if how == "allgather")
    slowdown = {"allgather": allgather_slowdown(gathered, bandwidth_bytes), "allreduce": 1.0}
    timed_bytes = sum(ring_bytes(b, workers, how) * slowdown[how] for b, how in payloads)
    payload = sum(b for b, _ in payloads)
    comm = timed_bytes / bandwidth_bytes + (latency_seconds * collectives if workers > 1 else 0.0)
    every = options.get("sync_every") if kind == "async" else None
    staleness = options.get("staleness", 1) if kind == "async" and every is None else 0
    if every:
        return Prediction(preset, compute_seconds + comm / every, comm / every, sent / every, payload / every)
    if staleness >= 1:
        return Prediction(preset, max(compute_seconds, comm), comm, sent, payload)
    return Prediction(preset, compute_seconds + comm, comm, sent, payload)


def fixed_presets():
    """Every preset with a fixed exchange (not ``auto``, which picks one of them while it runs)."""
    return [name for name in presets.preset_names() if presets.load_preset(name)["strategy"] != "auto"]


def advise(shapes, workers, bandwidth_bytes, compute_seconds, latency_seconds=DEFAULT_LATENCY_SECONDS, names=None,
           speeds=None, compressor_seconds=None):
    """Predictions for every preset (or `names`), fastest first; `compressor_seconds`: a dict
    preset -> measured compression compute per step (missing presets: 0)."""
    measured = compressor_seconds or {}
    rows = [predict(name, shapes, workers, bandwidth_bytes, compute_seconds, latency_seconds, speeds,
                    measured.get(name, 0.0))
            for name in (names or fixed_presets())]
    return sorted(rows, key=lambda r: r.seconds_per_step)


#: A preset must be predicted this much faster than sync to be recommended over it.
BEATS_SYNC_BY = 0.05


def recommendation(rows, holds=None, margin=BEATS_SYNC_BY):
    """The preset to use: the fastest one (of those `holds(name)` accepts, e.g. `holds_accuracy`),
    unless it is not `margin` (a fraction of sync's step) faster than sync."""
    chosen = [r for r in rows if holds is None or r.preset == "sync" or holds(r.preset)] or rows
    sync = next((r for r in rows if r.preset == "sync"), None)
    if sync is not None and chosen[0].seconds_per_step > (1 - margin) * sync.seconds_per_step:
        return "sync"
    return chosen[0].preset


def holds_accuracy(preset):
    """True for presets that train as sync does (MirroredStrategy: sync, balanced, zero1) and for
    those the preset grid measured within its band of sync in every cell."""
    if presets.load_variant(preset)["strategy"] == "mirrored":
        return True
    measured = presets.accuracy(presets.parse_variant(preset)[0])
    return bool(measured) and measured["within_band"] == measured["cells"]


def shapes_from_parameter_count(count):
    """A stand-in model of `count` parameters: square-ish float32 matrices of 1024 columns."""
    if count < 1:
        raise ValueError(f"The parameter count must be >= 1. Received: {count!r}")
    rows, rest = divmod(int(count), 1024)
    return [(rows, 1024)] + ([(rest,)] if rest else []) if rows else [(rest,)]


def shapes_from_model_file(path):
    """Trainable variable shapes of a saved Keras model."""
    import keras

    model = keras.models.load_model(path, compile=False)
    return [tuple(v.shape) for v in model.trainable_variables]


def model_step_seconds(path, batch_size, steps=8):
    """Median seconds of one training step of the saved model `path` on this machine: forward,
    backward and an update by its optimizer (SGD if it was saved uncompiled) on `batch_size`
    random rows of its input shape, one worker. The loss is the outputs' mean: labels do not
    change what a step computes."""
    import statistics

    import keras
    import numpy as np
    import tensorflow as tf

    import warnings

    from tfdp.comm.timing import timed_calls

    with warnings.catch_warnings():  # an optimizer saved unbuilt: "Skipping variable loading"
        warnings.simplefilter("ignore", UserWarning)
        model = keras.models.load_model(path)
    optimizer = model.optimizer if getattr(model, "optimizer", None) is not None else keras.optimizers.SGD(1e-3)
    x = tf.constant(np.random.default_rng(0).normal(size=(batch_size, *model.input_shape[1:])).astype("float32"))

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(x, training=True), tf.float32))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return statistics.median(timed_calls(lambda: step().numpy(), steps, untimed=2))  # two trace and build


def accuracy_note(preset):
    """What the preset grid measured of `preset` against sync, in a few words."""
    measured = presets.accuracy(preset)
    if presets.load_variant(preset)["strategy"] == "mirrored":
        return "the reference" if preset == "sync" else "exact: the sync trajectory"
    if measured is None:
        return "not on the preset grid"
    held = f"within {measured['band_pp']:g} pp in {measured['within_band']}/{measured['cells']} grid cells"
    if measured["within_band"] == measured["cells"]:
        return held
    return f"{held}; worst {measured['worst_pp']:+.1f} pp ({measured['worst']})"
