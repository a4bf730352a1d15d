"""Gradient reducers: what a worker does with its gradients before the optimizer update.

A reducer takes the list of local gradients (``None`` for variables without one)
and returns the list of gradients every worker applies.
"""

import tensorflow as tf



def densify(grad):
    # Horovod would all-gather IndexedSlices; a dense all-reduce keeps one code path
    # and is what float32 accounting assumes.
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


class AllReduceGradients:
    """Sum or average gradients across workers in one grouped (fused) all-reduce.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        op: ``"sum"`` when the loss is already divided by the number of workers
            (as Keras does under a strategy), ``"average"`` otherwise.

    Example:
        >>> reduce = AllReduceGradients(communicator, op="average")
        >>> grads = reduce(grads)
    """

    def __init__(self, communicator, op="sum"):
        if op not in ("sum", "average"):
            raise ValueError(f"`op` must be 'sum' or 'average'. Received: op={op!r}")
        self.communicator = communicator
        self.op = op

    def __call__(self, grads):
        grads = [None if g is None else densify(g) for g in grads]
        present = [g for g in grads if g is not None]
        self.communicator.stats.count_step(grads)
        self.communicator.stats.add("rounds", 1)
        reduced = iter(self.communicator.allreduce(present, op=self.op, gradients=True))
        return [None if g is None else next(reduced) for g in grads]
