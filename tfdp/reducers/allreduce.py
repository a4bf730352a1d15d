"""`AllReduceGradients`: the synchronous exchange of `tfdp.MirroredStrategy`."""

import os
import warnings

from tfdp.reducers.base import GradientReducer


def buckets(sizes, bucket_bytes):
    """Group positions into buckets of about `bucket_bytes`, last position first.

    Gradients of the last layers exist first in backprop, so their bucket can be all-reduced
    while earlier layers still compute. Each bucket holds whole tensors; one larger than
    `bucket_bytes` is a bucket of its own. ``bucket_bytes=None``: one bucket of everything.

    Example:
        >>> buckets([400, 400, 4000, 40], bucket_bytes=1000)
        [[3], [2], [1, 0]]
    """
    order = list(reversed(range(len(sizes))))
    if bucket_bytes is None:
        return [order] if order else []
    groups, current, filled = [], [], 0
    for i in order:
        if current and filled + sizes[i] > bucket_bytes:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
    if current:
        groups.append(current)
    return groups


#: ``bucket_bytes="auto"``. Measured (docs/results.md, overlap): the CNN workload on 2 emulated
#: hosts, 256 KiB buckets against one group: 1.17x faster per step at 100 Mbit/s, 1.24x at 400,
#: 0.98x on loopback (within this machine's noise); 1 MiB: 1.10x at 400 Mbit/s.
DEFAULT_BUCKET_BYTES = 256 * 1024


def check_bucket_bytes(bucket_bytes):
    """Return the bucket size `bucket_bytes` asks for (None, an integer >= 1, or ``"auto"``:
    `DEFAULT_BUCKET_BYTES`), else raise a ValueError naming it."""
    if bucket_bytes == "auto":
        return DEFAULT_BUCKET_BYTES
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
                                     or bucket_bytes < 1):
        raise ValueError(f"`bucket_bytes` must be None, \"auto\" or an integer >= 1 (e.g. 1 << 20). "
                         f"Received: bucket_bytes={bucket_bytes!r}")
    return bucket_bytes


def inter_op_threads():
    """The threads of TensorFlow's inter-op pool in this process: its setting, else
    ``TF_NUM_INTEROP_THREADS``, else the number of CPUs (TensorFlow's default)."""
    import tensorflow as tf

    return (tf.config.threading.get_inter_op_parallelism_threads()
            or int(os.environ.get("TF_NUM_INTEROP_THREADS") or 0) or os.cpu_count() or 1)


_warned_single_inter_op_thread = False


def warn_if_buckets_cannot_overlap(bucket_count, workers):
    """Warn once when several buckets are to overlap backprop but TensorFlow's inter-op pool has
    one thread: that thread mostly runs backprop to its end before it starts any of Horovod's ops,
    so the buckets wait for the last gradient (measured: docs/results.md, overlap; on one machine,
    stop 40, it started them early in about half of the steps)."""
    global _warned_single_inter_op_thread
    if bucket_count < 2 or workers < 2 or _warned_single_inter_op_thread or inter_op_threads() > 1:
        return
    _warned_single_inter_op_thread = True
    warnings.warn(
        "tfdp: TensorFlow's inter-op pool has 1 thread, so the gradient buckets' all-reduces mostly wait "
        "until backprop ends (little overlap of communication with backprop). Give it 2 threads before TensorFlow "
        "starts: TF_NUM_INTEROP_THREADS=2, or tf.config.threading.set_inter_op_parallelism_threads(2).",
        stacklevel=3)


class AllReduceGradients(GradientReducer):
    """Sum or average gradients across workers in grouped (fused) all-reduces.

    `IndexedSlices` (embedding gradients) travel as slices: their rows and indices are
    all-gathered, as `tf.distribute.MirroredStrategy` does. With `bucket_bytes` the dense
    gradients go in several grouped all-reduces of about that many bytes each, last
    layers first, each issued as soon as its gradients exist (TensorFlow runs an op when
    its inputs are ready; Horovod's ops are asynchronous), so communication overlaps the
    rest of backprop. The sums are the same numbers either way. ``bucket_bytes="auto"`` is
    `DEFAULT_BUCKET_BYTES`, or one group when TensorFlow's inter-op pool has one thread.

    Example:
        >>> reducer = AllReduceGradients(communicator, op="average", bucket_bytes=1 << 20)
        >>> grads = reducer.reduce(grads, variables)
    """

    sparse = True
    stateless_exchange = True

    def __init__(self, communicator, op="sum", bucket_bytes="auto", state=None):
        super().__init__(communicator, op, state)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._auto_buckets = bucket_bytes == "auto"

    def _bucket_size(self):
        """The bucket size of this trace: ``"auto"`` sends one group when TensorFlow's inter-op pool
        has one thread. Then no bucket can start before backprop ends, and each extra collective
        only costs (`make bench`, stop 33: one group 1.00-1.05x a hand-written Horovod train_step,
        256 KiB buckets 0.94-0.98x)."""
        if self._auto_buckets and inter_op_threads() < 2:
            return None
        return self.bucket_bytes

    def _reduce(self, grads, variables, opt):
        sizes = [g.shape.num_elements() * g.dtype.size for g in grads]
        result = [None] * len(grads)
        groups = buckets(sizes, self._bucket_size())
        warn_if_buckets_cannot_overlap(len(groups), self.communicator.size)
        for group in groups:
            summed = self.communicator.allreduce([grads[i] for i in group], op=self.op, gradients=True)
            for i, g in zip(group, summed):
                result[i] = g
        return result
