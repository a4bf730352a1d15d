"""`GradientReducer`: the one protocol between a strategy (or `DistributedOptimizer`) and the
code that exchanges gradients.

tfdp's Keras hooks call exactly these, on every reducer, never probing for others:

- ``reduce(grads, variables)`` once per optimizer update, where Keras clips gradients;
  returns the gradients every worker applies;
- ``after_update(variables)`` after the update;
- ``settle(apply_gradients)`` at the end of `fit` and before a checkpoint is written:
  finish what is in flight (apply stale gradients, average local models);
- ``state``, a `ReducerState` saved and restored with the optimizer (``saveable()``
  is the Keras object that carries it);
- ``stats()``, statistics beyond the communicator's counters.

The base class does the chores every reducer shares: None gradients stay None,
`IndexedSlices` either travel as slices (``sparse = True``: all-gather of rows and
indices) or are made dense, and every step is counted. Subclasses implement `_reduce`
for the dense gradients that are present.
"""

import abc

import tensorflow as tf

from tfdp.reducers.state import ReducerState, ReducerStateSaveable

_OPS = ("sum", "average")


def variable_key(variable):
    """The name tfdp keys per-variable state by: the Keras variable path (or TF name)."""
    return getattr(variable, "path", None) or variable.name


class GradientReducer(abc.ABC):
    """Base of every gradient reducer.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        op: ``"sum"`` when each worker's loss is already divided by the number of
            workers (as Keras does under a strategy), ``"average"`` otherwise.
    """

    #: IndexedSlices travel as slices (True) or are densified first (False).
    sparse = False
    #: Communication rounds per `reduce` (0: the subclass counts its own).
    rounds_per_step = 1
    #: Works with Keras's `gradient_accumulation_steps` (reduce runs once per real update).
    supports_accumulation = True
    #: How error messages name this exchange.
    description = "gradient exchange"
    #: Workers' optimizer states differ (they step on their own gradients): checkpoints keep every rank's.
    optimizer_state_per_rank = False

    def __init__(self, communicator, op="sum"):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}. Received: op={op!r}")
        self.communicator = communicator
        self.op = op
        self.state = ReducerState(communicator)

    def saveable(self, optimizer):
        """The Keras object that carries `state` into `optimizer`'s checkpoints."""
        return ReducerStateSaveable(self.state, optimizer if self.optimizer_state_per_rank else None)

    def reduce(self, grads, variables):
        """Return the gradients to apply: one per variable, None where `grads` has None."""
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"Expected one gradient per variable. Received {len(grads)} gradients "
                             f"for {len(variables)} variables.")
        self.communicator.stats.count_step(grads)
        if self.communicator.size > 1:
            self.communicator.stats.add("rounds", self.rounds_per_step)
        present = [i for i, g in enumerate(grads) if g is not None]
        slices = [i for i in present if self.sparse and isinstance(grads[i], tf.IndexedSlices)]
        dense = [i for i in present if i not in slices]
        result = list(grads)
        if dense:
            reduced = self._reduce([tf.convert_to_tensor(grads[i]) for i in dense], [variables[i] for i in dense])
            for i, g in zip(dense, reduced):
                result[i] = g
        for i, g in zip(slices, self._reduce_slices([grads[i] for i in slices])):
            result[i] = g
        return result

    @abc.abstractmethod
    def _reduce(self, grads, variables):
        """Reduce dense gradients (all present, one per variable); return them in order."""

    def _reduce_slices(self, slices):
        """All-gather rows and indices of IndexedSlices gradients; the optimizer adds duplicates."""
        if not slices:
            return []
        gathered = self.communicator.allgather_many(
            [s.values for s in slices] + [tf.cast(s.indices, tf.int64) for s in slices], gradients=True)
        values, indices = gathered[: len(slices)], gathered[len(slices):]
        scale = self.communicator.size if self.op == "average" else 1
        return [tf.IndexedSlices(v / scale if scale > 1 else v, i, s.dense_shape)
                for v, i, s in zip(values, indices, slices)]

    def after_update(self, variables):
        """Called after every optimizer update with the updated variables."""

    def settle(self, apply_gradients):
        """Finish in-flight work so that every rank holds the same, complete model.

        `apply_gradients(grads, variables)` applies already-reduced gradients. Called on
        every rank at the end of `fit` and before every checkpoint tfdp's callbacks write.
        """

    def stats(self):
        """Statistics beyond the communicator's counters (a dict of numbers)."""
        return {"max_staleness": 0}
