"""`AllReduceGradients`: the synchronous exchange of `tfdp.MirroredStrategy`."""

from tfdp.reducers.base import GradientReducer


class AllReduceGradients(GradientReducer):
    """Sum or average gradients across workers in one grouped (fused) all-reduce.

    `IndexedSlices` (embedding gradients) travel as slices: their rows and indices are
    all-gathered, as `tf.distribute.MirroredStrategy` does.

    Example:
        >>> reducer = AllReduceGradients(communicator, op="average")
        >>> grads = reducer.reduce(grads, variables)
    """

    sparse = True

    def _reduce(self, grads, variables, opt):
        return self.communicator.allreduce(grads, op=self.op, gradients=True)
