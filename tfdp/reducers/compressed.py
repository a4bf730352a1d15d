"""`CompressedGradients`: the gradient reducer of `tfdp.CompressedStrategy`."""

import tensorflow as tf

from tfdp.compression import RandomK, resolve
from tfdp.compression.error_feedback import ErrorFeedback
from tfdp.reducers.base import GradientReducer, variable_key

DEFAULT_MIN_COMPRESS_BYTES = 1024


class CompressedGradients(GradientReducer):
    """Compress each large gradient, exchange the payloads, apply the decompressed sum.

    Every rank decompresses the same delivered payloads in the same order, so all ranks
    apply the same gradient and their weights stay identical. Its state (error-feedback
    residuals, the codec's state, the step counter that drives the warm-up) is saved with
    the optimizer.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        codec: a `tfdp.compression` codec.
        error_feedback: add to each gradient what compression dropped from it before.
        warmup_steps: exchange dense float32 gradients for this many first steps.
        min_compress_bytes: gradients smaller than this (as float32) go dense.
        op: ``"sum"`` (losses already divided by the number of workers, as under a
            strategy) or ``"average"``.

    Example:
        >>> reducer = CompressedGradients(communicator, TopK(0.01), error_feedback=True)
        >>> grads = reducer.reduce(grads, variables)
    """

    def __init__(self, communicator, codec, error_feedback=True, warmup_steps=0,
                 min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, op="sum"):
        super().__init__(communicator, op)
        self.codec = codec
        self.memory = ErrorFeedback(self.state) if error_feedback else None
        self.warmup_steps = warmup_steps
        self.min_compress_bytes = min_compress_bytes
        self._step = self.state.variable("compression_step", lambda: tf.constant(0, tf.int64))

    def _compressed(self, grads, keys, step):
        if self.memory is not None:
            grads = [self.memory.compensate(k, g) for k, g in zip(keys, grads)]
        summed, sent = self.codec.exchange(grads, keys, step, self.communicator, self.state)
        if self.memory is not None:
            for k, g, s in zip(keys, grads, sent):
                self.memory.update(k, g, s)
        return summed

    def _reduce(self, grads, variables):
        large = [i for i, g in enumerate(grads) if g.shape.num_elements() * 4 >= self.min_compress_bytes]
        small = [i for i in range(len(grads)) if i not in large]
        step = tf.convert_to_tensor(self._step)
        keys = [variable_key(variables[i]) for i in large]
        chosen = [grads[i] for i in large]

        def compressed():
            return self._compressed(chosen, keys, step)

        def dense():
            return self.communicator.allreduce(chosen, op="sum", gradients=True)

        if not chosen:
            summed_large = []
        elif self.warmup_steps > 0:
            summed_large = tf.cond(step < self.warmup_steps, dense, compressed)
        else:
            summed_large = compressed()
        summed_small = self.communicator.allreduce([grads[i] for i in small], op="sum", gradients=True)
        self._step.assign_add(1)

        result = list(grads)
        for i, g in zip(large + small, list(summed_large) + list(summed_small)):
            result[i] = g / self.communicator.size if self.op == "average" else g
        return result


def compressed_reducer_factory(compressor, error_feedback, warmup_steps, min_compress_bytes, op):
    """Validate the compression options; return ``communicator -> CompressedGradients``.

    Shared by `CompressedStrategy` and `tfdp.DistributedOptimizer(compression=...)`.
    """
    codec = resolve(compressor)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"`error_feedback` must be True or False. Received: error_feedback={error_feedback!r}")
    if error_feedback and isinstance(codec, RandomK):
        raise ValueError(
            "randomk scales what it sends by 1/ratio, so its error is larger than the gradient "
            "and error feedback would diverge. Pass error_feedback=False with randomk."
        )
    for name, value in (("warmup_steps", warmup_steps), ("min_compress_bytes", min_compress_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"`{name}` must be an integer >= 0. Received: {name}={value!r}")
    return lambda communicator: CompressedGradients(
        communicator, codec, error_feedback=error_feedback, warmup_steps=warmup_steps,
        min_compress_bytes=min_compress_bytes, op=op)
