"""`tfdp.MirroredStrategy`: synchronous data parallelism across Horovod workers."""

from tfdp.reducers import AllReduceGradients
from tfdp.reducers.allreduce import check_bucket_bytes
from tfdp.reducers.sharded import ShardedOptimizerState, check_partition
from tfdp.strategies.base import HorovodStrategy


class MirroredStrategy(HorovodStrategy):
    """Synchronous data parallelism: gradients all-reduced through Horovod every step.

    Launch the same script on every worker (``horovodrun -np 2 python train.py``);
    without horovodrun it runs as one plain process. ``batch_size`` passed to
    ``fit`` is the global batch: each worker trains on its share of every batch,
    so P workers follow the single-process trajectory of the same batch size.
    Initial variables are broadcast from rank 0 when they are created, after a check
    that every worker builds the same variables (matched by creation order, shape and
    dtype). Only rank 0 writes to stdout (progress bars, prints) and writes checkpoints
    and TensorBoard logs; ``TFDP_VERBOSE_WORKERS=1`` or `tfdp.set_worker_stdout(True)`
    keeps every rank's stdout.

    Args:
        global_step_logs: make every batch's logs (progress bar, batch-level
            callbacks) global with one small all-reduce per step. It depends on the
            forward pass only, so it runs during backprop: False measured no faster
            (``benchmarks/fit_overhead.py --also no-step-logs``). With
            False, a training step's batch logs are this rank's running values;
            epoch logs, ``History``, ``evaluate`` and ``test_on_batch`` are global
            either way (custom steps' own values too). Keep True when a
            batch-level callback can stop training (TerminateOnNaN): every rank
            must stop at the same step.
        skip_nonfinite: skip the update on every rank together when any rank's
            gradients hold a NaN or Inf (decided on the all-reduced gradients, so
            all ranks agree without an extra collective); `skipped_steps()` counts
            them. Not with ``gradient_accumulation_steps``.
        balance: each worker's share of every global batch. None: equal shares.
            ``"auto"``: shares follow each worker's measured compute speed,
            re-estimated every 20 steps (one small all-gather), with hysteresis; for
            workers of different speeds. A list of weights, one per worker (e.g.
            ``[0.7, 0.3]``): fixed shares, for known hardware. Uneven shares follow
            the one-process trajectory of the same global batch (gradients and
            synchronized batch norm are weighted by rows; step logs too).
            `balance_stats()` reports the shares. See `tfdp.strategies.balance`.
        bucket_bytes: an integer: buckets of about that many bytes, last layers first,
            each all-reduced as soon as its gradients exist (overlap with backprop); the
            same sums. ``"auto"`` (default): 256 KiB (measured, see
            `tfdp.reducers.allreduce.DEFAULT_BUCKET_BYTES`), or one group when TensorFlow's
            inter-op pool has one thread (nothing could overlap). None: one grouped
            all-reduce of every gradient after backprop.
        shard_optimizer_state: False: every worker keeps the whole optimizer state. True
            (or ``"flat"``, ``"variables"``): ZeRO stage 1, each worker keeps the optimizer
            state of 1/P of the model; gradients are reduce-scattered, each worker updates its
            shard with your optimizer, the updated weights are all-gathered (the bytes of one
            all-reduce). Same weights as without it; checkpoints hold the whole state (loadable
            by plain Keras, or by any number of workers). `memory_stats(optimizer)` reports
            the bytes. Under mixed_float16 the LossScaleOptimizer's inner optimizer is sharded
            and every worker skips the same overflowing steps. Not with an explicit ``bucket_bytes``,
            ``skip_nonfinite`` or gradient accumulation. See `tfdp.reducers.sharded`.

    Example:
        >>> import keras, tfdp
        >>> strategy = tfdp.MirroredStrategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    """

    def __init__(self, global_step_logs=True, skip_nonfinite=False, balance=None, bucket_bytes="auto",
                 shard_optimizer_state=False):
        check_bucket_bytes(bucket_bytes)
        partition = _sharding(shard_optimizer_state)
        explicit_buckets = bucket_bytes not in (None, "auto")
        if partition is not None and (explicit_buckets or skip_nonfinite):
            raise ValueError(
                "shard_optimizer_state does not combine with "
                f"{'bucket_bytes' if explicit_buckets else 'skip_nonfinite=True'} (its reduce-scatter is "
                "one collective, and each worker sees only its shard of the reduced gradients). Drop one of them.")

        def make_reducer(communicator):
            if partition is not None:
                return ShardedOptimizerState(communicator, partition)
            return AllReduceGradients(communicator, op="sum", bucket_bytes=bucket_bytes)

        super().__init__(
            make_reducer,
            global_step_logs=global_step_logs,
            skip_nonfinite=skip_nonfinite,
            balance=balance,
        )


def _sharding(shard_optimizer_state):
    """The partition `shard_optimizer_state` asks for, or None (no sharding)."""
    if shard_optimizer_state is False or shard_optimizer_state is None:
        return None
    if shard_optimizer_state is True:
        return "auto"
    return check_partition(shard_optimizer_state)
