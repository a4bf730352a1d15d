"""Stateless gradient codecs: ``compress(x, step) -> (payload, ctx)``, ``decompress``.

A codec declares how its payloads travel. ``summable`` payloads are summed across
workers by all-reduce and `decompress` turns the sum into a tensor. Other payloads are
all-gathered, each tensor with a leading axis of workers; `decompress` then receives
that stacked payload and returns the sum of every worker's tensor.

Example:
    >>> codec = TopK(ratio=0.01)
    >>> payload, ctx = codec.compress(grad, step=0)
    >>> restored = codec.decompress([p[None] for p in payload], ctx)  # one worker
"""

import math

import tensorflow as tf


def _check_ratio(ratio):
    if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"`ratio` must be in (0, 1]. Received: ratio={ratio!r}")
    return float(ratio)


class Identity:
    """Send float32 gradients unchanged (the reference every codec is measured against)."""

    name = "none"
    summable = True

    def compress(self, x, step):
        return [x], x.dtype

    def decompress(self, payload, ctx):
        return tf.cast(payload[0], ctx)


class Cast:
    """Send gradients as a 16-bit float (``float16`` or ``bfloat16``): 2x fewer bytes.

    float16 keeps 11 significant bits but overflows above 65504; bfloat16 keeps float32's
    range with 8 significant bits. Sums run in the 16-bit type, as Horovod's fp16
    compression does.
    """

    summable = True

    def __init__(self, dtype):
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"`dtype` must be 'float16' or 'bfloat16'. Received: dtype={dtype!r}")
        self.dtype = tf.as_dtype(dtype)
        self.name = {"float16": "fp16", "bfloat16": "bf16"}[dtype]

    def compress(self, x, step):
        return [tf.cast(x, self.dtype)], x.dtype

    def decompress(self, payload, ctx):
        return tf.cast(payload[0], ctx)


def _k(n, ratio):
    return max(1, int(math.ceil(n * ratio)))


def _scatter_dense(indices, values, shape, dtype):
    """Dense tensor of `shape` with `values` at flat `indices` (repeated indices add up)."""
    dense = tf.scatter_nd(indices[:, None], tf.cast(values, dtype), [shape.num_elements()])
    return tf.reshape(dense, shape)


class TopK:
    """Send the ``ratio`` fraction of entries with the largest magnitude, with int32 indices.

    Biased: use it with error feedback (Stich et al., https://arxiv.org/abs/1809.07599),
    which sends the dropped remainder later. 1% is a common starting point.
    """

    name = "topk"
    summable = False

    def __init__(self, ratio=0.01):
        self.ratio = _check_ratio(ratio)

    def compress(self, x, step):
        flat = tf.reshape(x, [-1])
        _, indices = tf.math.top_k(tf.abs(flat), k=_k(int(flat.shape[0]), self.ratio), sorted=False)
        return [tf.gather(flat, indices), tf.cast(indices, tf.int32)], (x.shape, x.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        values, indices = (tf.reshape(p, [-1]) for p in payload)  # All workers' pairs.
        return _scatter_dense(indices, values, shape, dtype)


class RandomK:
    """Send a random ``ratio`` fraction of entries, scaled by 1/ratio so the estimate is unbiased.

    Every worker draws the same indices from (`seed`, step), so only values travel and
    they can be summed (Stich et al., https://arxiv.org/abs/1809.07599).
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio=0.01, seed=0):
        self.ratio = _check_ratio(ratio)
        self.seed = int(seed)

    def _indices(self, n, step):
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        scores = tf.random.stateless_uniform([n], seed=seed)
        return tf.math.top_k(scores, k=_k(n, self.ratio), sorted=False).indices

    def compress(self, x, step):
        flat = tf.reshape(x, [-1])
        n = int(flat.shape[0])
        indices = self._indices(n, step)
        scale = tf.cast(n / _k(n, self.ratio), x.dtype)
        return [tf.gather(flat, indices) * scale], (x.shape, x.dtype, indices)

    def decompress(self, payload, ctx):
        shape, dtype, indices = ctx
        return _scatter_dense(indices, payload[0], shape, dtype)


class QSGD:
    """Stochastic quantisation to ``levels`` magnitudes of the vector norm, int8 payload.

    Unbiased; the error of each entry is at most norm/levels
    (Alistarh et al., https://arxiv.org/abs/1610.02132). ``levels`` ≤ 127.
    """

    name = "qsgd"
    summable = False

    def __init__(self, levels=64, seed=0):
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"`levels` must be an integer in [1, 127]. Received: levels={levels!r}")
        self.levels = levels
        self.seed = int(seed)

    def compress(self, x, step):
        flat = tf.reshape(tf.cast(x, tf.float32), [-1])
        norm = tf.norm(flat)
        scaled = tf.math.divide_no_nan(tf.abs(flat), norm) * self.levels
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        noise = tf.random.stateless_uniform(tf.shape(flat), seed=seed)
        level = tf.minimum(tf.floor(scaled + noise), self.levels)
        quantised = tf.cast(tf.sign(flat) * level, tf.int8)
        return [tf.reshape(norm, [1]), quantised], (x.shape, x.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        norms, quantised = payload  # [workers, 1], [workers, n]
        per_worker = tf.cast(quantised, tf.float32) * norms / self.levels
        return tf.cast(tf.reshape(tf.reduce_sum(per_worker, axis=0), shape), dtype)
