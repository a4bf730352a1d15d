"""Thin layer over Horovod collectives that counts what it sends.

Everything tfdp exchanges between workers goes through a `Communicator`, so
`communication_stats()` is a count of real calls, not an estimate.
"""

import tensorflow as tf

from tfdp._horovod import horovod
from tfdp._state import local_variable


class CommunicationStats:
    """Counters of what this worker handed to collectives.

    They are `tf.Variable`s so that steps running inside `tf.function` update them.
    `payload_bytes` counts every byte handed to a collective (gradients, metrics,
    initial broadcasts); `gradient_bytes` the part of it that carried gradients
    (payloads, indices, scales and norms); `dense_bytes` what the same gradients
    would have taken as float32 all-reduce.
    """

    FIELDS = ("steps", "collectives", "payload_bytes", "gradient_bytes", "dense_bytes", "rounds")

    def __init__(self):
        self._vars = {
            name: local_variable(tf.constant(0, tf.int64), f"tfdp_{name}") for name in self.FIELDS
        }

    def add(self, name, amount):
        """Add `amount` (a Python int or an integer tensor) to counter `name`."""
        return self._vars[name].assign_add(tf.cast(amount, tf.int64))

    def count_step(self, grads):
        """Count one gradient step and the float32 size of its (non-None) gradients."""
        self.add("steps", 1)
        present = [g for g in grads if g is not None]
        if present:
            self.add("dense_bytes", tf.add_n([float32_bytes(g) for g in present]))

    def as_dict(self):
        """Return the counters as Python ints."""
        return {name: int(var.numpy()) for name, var in self._vars.items()}


def nbytes(tensor):
    """Return the size of `tensor` in bytes as an int64 tensor (works for dynamic shapes)."""
    return tf.size(tensor, out_type=tf.int64) * tensor.dtype.size


def float32_bytes(tensor):
    """Return what `tensor` would take as float32, in bytes."""
    return tf.size(tensor, out_type=tf.int64) * 4


class Communicator:
    """Collectives across all Horovod workers, counted in a `CommunicationStats`.

    With one worker every collective is the identity and nothing is counted.

    Example:
        >>> comm = Communicator(CommunicationStats())
        >>> [total] = comm.allreduce([tf.ones([3])], op="sum")
    """

    def __init__(self, stats):
        self._hvd = horovod()
        self.stats = stats

    @property
    def rank(self):
        return self._hvd.rank()

    @property
    def size(self):
        return self._hvd.size()

    def _count(self, tensors, gradients=False):
        if not tensors:
            return
        self.stats.add("collectives", 1)
        total = tf.add_n([nbytes(t) for t in tensors])
        self.stats.add("payload_bytes", total)
        if gradients:
            self.stats.add("gradient_bytes", total)

    def allreduce(self, tensors, op="sum", gradients=False):
        """Sum or average a list of tensors across workers in one fused collective.

        ``gradients=True`` also counts the bytes as gradient traffic.
        """
        if op not in ("sum", "average"):
            raise ValueError(f"`op` must be 'sum' or 'average'. Received: op={op!r}")
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return tensors
        hvd_op = self._hvd.Sum if op == "sum" else self._hvd.Average
        self._count(tensors, gradients)
        return list(self._hvd.grouped_allreduce(tensors, op=hvd_op))

    def allgather_stacked(self, tensors, gradients=False):
        """Gather each tensor from every worker into a new leading axis of workers.

        One grouped collective per dtype (Horovod groups only tensors of one dtype).
        """
        tensors = [t[None] for t in tensors]
        if self.size == 1 or not tensors:
            return tensors
        gathered = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            chosen = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            group = [tensors[i] for i in chosen]
            self._count(group, gradients)
            for i, result in zip(chosen, self._hvd.grouped_allgather(group)):
                gathered[i] = result
        return gathered

    def allgather(self, tensor):
        """Concatenate `tensor` from every worker along axis 0, in rank order."""
        if self.size == 1:
            return tensor
        self._count([tensor])
        return self._hvd.allgather(tensor)

    def broadcast(self, tensor, root_rank=0):
        """Return root's `tensor` on every worker."""
        if self.size == 1:
            return tensor
        self._count([tensor])
        return self._hvd.broadcast(tensor, root_rank)
