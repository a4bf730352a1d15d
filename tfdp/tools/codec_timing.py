"""Time a compressed preset's compute on given gradient shapes, on this machine.

A compressed step adds compute a dense step does not have: compressing every gradient,
decompressing what arrives, keeping the error-feedback residual. `compressor_seconds` runs a
preset's own reducer (`CompressedGradients`, as `CompressedStrategy` builds it, after its
warm-up) over random gradients of the given shapes on a one-worker communicator, so nothing
travels and what is timed is that compute (with the update itself, one pass over the weights
that a dense step makes too). The advisor adds it to its prediction.

Example:
    >>> compressor_seconds("topk-1pct", [(1024, 1024), (1024,)])  # seconds per step
"""

import gc
import statistics

import numpy as np
import tensorflow as tf

from tfdp import presets
from tfdp.comm.fake import fake_group
from tfdp.comm.timing import timed_calls
from tfdp.auto import reducer_factory


def preset_reducer(preset, communicator):
    """The gradient reducer `preset` trains with (compressed presets only), warm-up left out."""
    spec = presets.load_variant(preset)
    if spec["strategy"] != "compressed":
        raise ValueError(f"{preset!r} is not a compressed preset (its strategy is {spec['strategy']!r}).")
    return reducer_factory(preset, warmup=False)(communicator)


def compressor_seconds(preset, shapes, repeats=5, seed=0, ready=None):
    """Median seconds one step of `preset`'s compression takes on gradients of `shapes`
    (0.0 for presets that do not compress). Runs on this process's TensorFlow threads;
    `ready` (if given) is called after tracing, right before the timed steps."""
    return statistics.median(compressor_step_seconds(preset, shapes, repeats, seed, ready))


def compressor_step_seconds(preset, shapes, repeats=5, seed=0, ready=None):
    """Seconds of each of `repeats` steps of `preset`'s compression on gradients of `shapes`
    (zeros for presets that do not compress), after one that traces: `compressor_seconds`
    without the median, for baselines that combine the steps of several processes."""
    if presets.load_variant(preset)["strategy"] != "compressed":
        return [0.0] * repeats
    seconds = _timed_steps(preset, shapes, repeats, seed, ready)
    # A traced tf.function sits in reference cycles with what it captured; without a collection
    # here the advisor holds every timed preset's residuals and weights at once (on a 6 M
    # parameter model, 180 MB more peak memory over the six candidates).
    gc.collect()
    return seconds


def _timed_steps(preset, shapes, repeats, seed, ready=None):
    """Seconds of each of `repeats` steps of `preset`'s reducer, after one that traces."""
    communicator = fake_group(1)[0]
    reducer = preset_reducer(preset, communicator)
    rng = np.random.default_rng(seed)
    variables = [tf.Variable(tf.zeros(shape), name=f"timed{i}") for i, shape in enumerate(shapes)]
    # Heavy-tailed, like gradients (top-k's threshold depends on the distribution).
    grads = [tf.constant(rng.standard_t(3, size=shape).astype("float32") * 1e-3) for shape in shapes]

    @tf.function
    def step():
        # The whole protocol: presets that exchange each worker's step (local residual) do
        # their compression after the update.
        reducer.before_update(variables)
        for variable, grad in zip(variables, reducer.reduce(grads, variables)):
            variable.assign_sub(grad)
        reducer.after_update(variables)
        return [tf.reduce_sum(v) for v in variables]

    return timed_calls(step, repeats, ready=ready)  # after one call that traces


__all__ = ["compressor_seconds", "compressor_step_seconds", "preset_reducer"]
