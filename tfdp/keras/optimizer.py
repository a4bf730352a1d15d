"""`tfdp.DistributedOptimizer`: Horovod-averaged gradients for any Keras 3 optimizer."""

import keras

from tfdp import _compat
from tfdp._compat.keras import bind_reducer, bind_reducer_to_parts, bound_reducer
from tfdp.comm import HorovodCommunicator
from tfdp.reducers import DEFAULT_MIN_COMPRESS_BYTES, AllReduceGradients, compressed_reducer_factory
from tfdp.reducers.allreduce import check_bucket_bytes

_OPS = ("average", "sum")


def DistributedOptimizer(optimizer, op="average", backward_passes_per_step=1,  # noqa: N802 (Horovod's name)
                         compression=None, error_feedback=True, bucket_bytes="auto"):
    """Make `optimizer` average its gradients across Horovod workers before each update.

    For custom training loops and for `fit` without a tfdp strategy. The optimizer
    object itself is returned, not a wrapper class, so a saved model reloads with
    the plain base optimizer. The exchange happens where Keras clips gradients, so
    ``clipnorm``/``global_clipnorm`` act on the averaged gradient; a
    `LossScaleOptimizer` checks finiteness on the averaged gradient, one decision for
    all workers.

    Args:
        optimizer: a Keras 3 optimizer (built or not).
        op: ``"average"`` (the usual choice with per-worker losses) or ``"sum"``.
        backward_passes_per_step: accumulate this many local gradients before one
            exchange (uses Keras's ``gradient_accumulation_steps``).
        compression: None for float32 all-reduce, or a compressor as accepted by
            `tfdp.CompressedStrategy` (``"fp16"``, ``{"name": "topk", "ratio":
            0.01}``, a `tfdp.compression` codec).
        error_feedback: with `compression`, keep what compression dropped and send
            it later (False for randomk).
        bucket_bytes: without `compression`, all-reduce in buckets of about this many
            bytes, last layers first, overlapping backprop; ``"auto"``: 256 KiB (one group
            with one inter-op thread), None: one group (see `tfdp.MirroredStrategy`).

    Returns:
        `optimizer`, with ``optimizer.communication_stats()`` added.

    Raises:
        ValueError: bad `op`, `backward_passes_per_step` or compression options.

    Example:
        >>> opt = tfdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.apply(grads, model.trainable_variables)
        >>> opt = tfdp.DistributedOptimizer(keras.optimizers.Adam(), compression="fp16")
    """
    if op not in _OPS:
        raise ValueError(f"`op` must be one of {_OPS}. Received: op={op!r}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            "`backward_passes_per_step` must be an integer >= 1. "
            f"Received: backward_passes_per_step={backward_passes_per_step!r}"
        )
    if bound_reducer(optimizer) is not None:
        raise ValueError("This optimizer is already a tfdp.DistributedOptimizer.")
    if backward_passes_per_step > 1:
        if isinstance(optimizer, keras.optimizers.MultiOptimizer):
            raise ValueError(
                "`backward_passes_per_step` > 1 does not reach a MultiOptimizer's sub-optimizers (Keras's "
                "MultiOptimizer.apply skips gradient accumulation). Give each sub-optimizer "
                "`gradient_accumulation_steps` instead, and leave backward_passes_per_step=1.")
        if optimizer.built or optimizer.gradient_accumulation_steps:
            raise ValueError(
                "`backward_passes_per_step` > 1 needs an optimizer that is not built yet "
                "and has no `gradient_accumulation_steps` of its own."
            )
        optimizer.gradient_accumulation_steps = backward_passes_per_step
    check_bucket_bytes(bucket_bytes)
    if compression is None:
        make_reducer = lambda communicator: AllReduceGradients(communicator, op=op,  # noqa: E731
                                                               bucket_bytes=bucket_bytes)
    else:
        make_reducer = compressed_reducer_factory(
            compression, error_feedback, warmup_steps=0,
            min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, op=op)
    _compat.install()
    reducer = make_reducer(HorovodCommunicator())
    bind_reducer(optimizer, reducer)
    bind_reducer_to_parts(optimizer)  # a MultiOptimizer's sub-optimizers known so far; the rest at build

    def communication_stats():
        return {**reducer.communicator.stats.as_dict(), **reducer.stats()}

    # object.__setattr__: Keras's auto-tracking must not adopt it as optimizer state.
    object.__setattr__(optimizer, "communication_stats", communication_stats)
    return optimizer
