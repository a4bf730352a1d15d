"""`CompressedGradients`: the gradient reducer of `tfdp.CompressedStrategy`."""

import tensorflow as tf

from tfdp._state import local_variable
from tfdp.compression.error_feedback import ErrorFeedback
from tfdp.reducers import densify

DEFAULT_MIN_COMPRESS_BYTES = 1024


def _key(index, grad):
    dims = "x".join(str(d) for d in grad.shape) or "scalar"
    return f"g{index}_{dims}_{grad.dtype.name}"


class CompressedGradients:
    """Compress each large gradient, exchange the payloads, apply the decompressed sum.

    Every rank decompresses the same delivered payloads in the same order, so all ranks
    apply the same gradient and their weights stay identical.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        codec: a `tfdp.compression` codec.
        error_feedback: add to each gradient what compression dropped from it before.
        warmup_steps: exchange dense float32 gradients for this many first steps.
        min_compress_bytes: gradients smaller than this (as float32) go dense.
        op: ``"sum"`` (losses already divided by the number of workers, as under a
            strategy) or ``"average"``.

    Example:
        >>> reduce = CompressedGradients(communicator, TopK(0.01), error_feedback=True)
        >>> grads = reduce(grads)
    """

    def __init__(self, communicator, codec, error_feedback=True, warmup_steps=0,
                 min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, op="sum"):
        if op not in ("sum", "average"):
            raise ValueError(f"`op` must be 'sum' or 'average'. Received: op={op!r}")
        self.communicator = communicator
        self.codec = codec
        self.memory = ErrorFeedback() if error_feedback else None
        self.warmup_steps = warmup_steps
        self.min_compress_bytes = min_compress_bytes
        self.op = op
        self._step = local_variable(tf.constant(0, tf.int64), "tfdp_compression_step")

    def _compressed(self, grads, keys, step):
        if self.memory is not None:
            grads = [self.memory.compensate(k, g) for k, g in zip(keys, grads)]
        summed, sent = self.codec.exchange(grads, keys, step, self.communicator)
        if self.memory is not None:
            for k, g, s in zip(keys, grads, sent):
                self.memory.update(k, g, s)
        return summed

    def _dense(self, grads):
        return self.communicator.allreduce(grads, op="sum", gradients=True)

    def __call__(self, grads):
        grads = [None if g is None else densify(g) for g in grads]
        chosen = [i for i, g in enumerate(grads)
                  if g is not None and g.shape.num_elements() * 4 >= self.min_compress_bytes]
        small = [i for i, g in enumerate(grads) if g is not None and i not in chosen]
        step = tf.convert_to_tensor(self._step)
        keys = [_key(i, grads[i]) for i in chosen]
        large = [grads[i] for i in chosen]

        def compressed():
            return self._compressed(large, keys, step)

        def dense():
            return self._dense(large)

        if not large:
            summed_large = []
        elif self.warmup_steps > 0:
            summed_large = tf.cond(step < self.warmup_steps, dense, compressed)
        else:
            summed_large = compressed()
        summed_small = self._dense([grads[i] for i in small])

        self.communicator.stats.count_step(grads)
        self.communicator.stats.add("rounds", 1)
        self._step.assign_add(1)

        result = list(grads)
        for i, g in zip(chosen + small, list(summed_large) + list(summed_small)):
            result[i] = g / self.communicator.size if self.op == "average" else g
        return result
