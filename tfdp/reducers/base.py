"""`GradientReducer`: the one protocol between a strategy (or `DistributedOptimizer`) and the
code that exchanges gradients.

tfdp's Keras hooks call exactly these, on every reducer, never probing for others:

- ``reduce(grads, variables, optimizer)`` once per optimizer update, where Keras clips
  gradients; returns the gradients every worker applies, in the optimizer's terms (a
  reducer may steer the optimizer's momentum, see `tfdp.reducers.optimizer_view`);
- ``replaces_clipping(optimizer)``: the reducer clipped locally, Keras must not clip again;
- ``before_update(variables, optimizer)`` and ``after_update(variables, updated)`` around
  every optimizer update (``updated``: under gradient accumulation, whether this call
  applied the accumulated gradients; None otherwise);
- ``settle(apply_gradients)`` at the end of `fit`, before a checkpoint is written and before
  `evaluate` or `predict` outside `fit` when ``unsettled()``: finish what is in flight (apply
  stale gradients, average the workers' models);
- ``state``, a `ReducerState` saved and restored with the optimizer (``saveable()``
  is the Keras object that carries it);
- ``stats()``, statistics beyond the communicator's counters.

The base class does the chores every reducer shares: None gradients stay None,
`IndexedSlices` either travel as slices (``sparse = True``: the rows a step touched, or
dense when the cost model says so, see `tfdp.reducers.sparse`) or are made dense, every
step is counted, and gradients are weighted by rows.
Subclasses implement `_reduce` for the dense gradients that are present.

Rows: Keras divides each replica's mean loss by the number of replicas P, which equals the
global mean only when every rank holds as many rows (not for a last partial batch split
2/3, say). Inside a Keras training step (`rows_of_this_step`), each rank sends
``rows * g`` and its row count in the same exchange, and applies
``P * sum(rows * g) / sum(rows)``: the gradient of the global mean, for any split.
Reducers that carry gradients from step to step (error feedback) set ``weights_rows``
False: a residual kept at one step's scale would be unweighted at another's.

Equal rows on every rank (every full batch without ``balance``) need no weighting: the
plain sum is the global mean's gradient. A reducer whose exchange has no state
(``stateless_exchange``: the all-reduce) sends the plain gradients with ``[rows, rows²]``;
the ranks' rows were all equal exactly when ``(Σ rows)² = P Σ rows²``, and then the sum is
applied as it is, at no cost beyond two floats. Otherwise (a last, uneven batch) every
rank finds the same and the exchange runs again, row-weighted. The weighting's two passes
over every gradient are gone from the common step.
"""

import abc
import contextlib
import math
import threading

import tensorflow as tf

from tfdp._compat.keras import built_variables, counts_a_training_step
from tfdp.reducers.optimizer_view import view as optimizer_view
from tfdp.reducers.sparse import exchange_slices
from tfdp.reducers.state import ReducerState, ReducerStateSaveable

_OPS = ("sum", "average")


def variable_key(variable):
    """The name tfdp keys per-variable state by: the Keras variable path (or TF name)."""
    return getattr(variable, "path", None) or variable.name


def update_group(variables):
    """A key for the variables one optimizer updates, the same at every update of that optimizer.

    A model may update its variables with several optimizers (Keras's GAN guide: one for the
    generator, one for the discriminator); reducers that carry work from one update to a later
    one keep it per group. The key is local to this process: ranks pair their collectives by
    the order they issue them, which is the same on every rank.
    """
    return tuple(id(v) for v in variables)


_step = threading.local()


@contextlib.contextmanager
def rows_of_this_step(rows, even_likely=True):
    """Within this block, reductions weight this rank's gradients by `rows` (a scalar tensor).

    ``even_likely=False`` (uneven shares by design, ``balance``): weight at once, without first
    trying the plain sum.
    """
    previous = getattr(_step, "rows", None), getattr(_step, "even_likely", True)
    _step.rows, _step.even_likely = rows, even_likely
    try:
        yield
    finally:
        _step.rows, _step.even_likely = previous


def rows_in_this_step():
    """This rank's rows inside a Keras training step (a scalar tensor), else None."""
    return getattr(_step, "rows", None)


class _RowCountSlot:
    """Stands in for a variable beside the row count exchanged with the gradients."""

    path = name = "tfdp/row_count"


#: The "variable" of the row count a reducer's `_reduce` may receive last.
ROW_COUNT = _RowCountSlot()


class GradientReducer(abc.ABC):
    """Base of every gradient reducer.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        op: ``"sum"`` when each worker's loss is already divided by the number of
            workers (as Keras does under a strategy), ``"average"`` otherwise.
        state: the `ReducerState` to keep variables in (default: a new one); a reducer that
            takes over from another (`tfdp.reducers.SwitchingReducer`) shares its state.
    """

    #: IndexedSlices travel as slices (True) or are densified first (False).
    sparse = False
    #: Communication rounds per `reduce` (0: the subclass counts its own).
    rounds_per_step = 1
    #: Works with Keras's `gradient_accumulation_steps` (reduce runs once per real update).
    supports_accumulation = True
    #: How error messages name this exchange.
    description = "gradient exchange"
    #: Workers step on their own gradients, so their optimizer states differ (checkpoints keep every
    #: rank's) and a loss-scaling optimizer's skip of a non-finite step must be agreed by all ranks.
    optimizer_state_per_rank = False
    #: Weight gradients by rows inside Keras training steps (see the module docstring).
    weights_rows = True
    #: Builds the strategy's optimizers on shards of the model (`tfdp.reducers.sharded`).
    shards_optimizer_state = False
    #: `_reduce` keeps no state, so it may run twice in a step (see the module docstring: equal rows).
    stateless_exchange = False
    #: Every training step waits for every rank before its update. False where workers step on their
    #: own and exchange later or less often (delayed averaging, stale gradients, local SGD): a sum
    #: across ranks inside their steps (a masked loss's global count) would add a wait to each step.
    lockstep = True

    def __init__(self, communicator, op="sum", state=None):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}. Received: op={op!r}")
        self.communicator = communicator
        self.op = op
        self.state = ReducerState(communicator) if state is None else state

    def saveable(self, optimizer):
        """The Keras object that carries `state` into `optimizer`'s checkpoints."""
        return ReducerStateSaveable(self.state, optimizer if self.optimizer_state_per_rank else None)

    def reduce(self, grads, variables, optimizer=None):
        """Return the gradients to apply: one per variable, None where `grads` has None.

        `optimizer` is the Keras optimizer that will apply them (None in custom code).
        """
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"Expected one gradient per variable. Received {len(grads)} gradients "
                             f"for {len(variables)} variables.")
        self.communicator.stats.count_step(grads, self.rounds_per_step if self.communicator.size > 1 else 0,
                                           new_step=counts_a_training_step())
        present = [i for i, g in enumerate(grads) if g is not None]
        slices = [i for i in present if self.sparse and isinstance(grads[i], tf.IndexedSlices)]
        dense = [i for i in present if i not in slices]
        opt = optimizer_view(optimizer)
        rows = getattr(_step, "rows", None) if self.communicator.size > 1 and self.weights_rows else None
        if rows is not None and dense and not slices and self.stateless_exchange \
                and getattr(_step, "even_likely", True):
            reduced, gathered = self._sum_assuming_even_rows(grads, variables, dense, opt, rows)
        else:
            reduced, gathered = self._sum_weighted_by_rows(grads, variables, dense, slices, opt, rows)
        if dense:
            reduced = self._after_reduce(list(reduced), [variables[i] for i in dense], opt)
        result = list(grads)
        for i, g in zip(dense + slices, list(reduced) + list(gathered)):
            result[i] = g
        return result

    def _sum_weighted_by_rows(self, grads, variables, dense, slices, opt, rows):
        """The summed dense gradients (before `_after_reduce`) and slices, row-weighted unless `rows`
        is None."""
        weight = (lambda g: g) if rows is None else (lambda g: _scaled(g, tf.cast(rows, tf.float32), no_nan=True))
        dense_grads = [weight(_dense(grads[i], variables[i])) for i in dense]
        dense_vars = [variables[i] for i in dense]
        if rows is not None:  # the row count rides along in the same exchange
            dense_grads.append(tf.reshape(tf.cast(rows, tf.float32), [1]))
            dense_vars.append(ROW_COUNT)
        reduced = self._reduce(dense_grads, dense_vars, opt) if dense_grads else []
        gathered = self._reduce_slices([weight(grads[i]) for i in slices], opt)
        if rows is not None:
            *reduced, total = reduced
            gathered = [self.unweight(g, total) for g in gathered]
            reduced = [self.unweight(g, total) for g in reduced]
        return list(reduced), list(gathered)

    def _sum_assuming_even_rows(self, grads, variables, dense, opt, rows):
        """The plain sum, sent with ``[rows, rows²]``; the row-weighted exchange again if the ranks'
        rows differed (the same decision on every rank: they all hold the same sums)."""
        count = tf.cast(rows, tf.float32)
        *summed, counts = self._reduce([_dense(grads[i], variables[i]) for i in dense] + [tf.stack([count, count * count])],
                                       [variables[i] for i in dense] + [ROW_COUNT], opt)
        # Exact in float32 while P * rows² < 2**24 (rows per rank below 2,896 on 2 workers).
        even = tf.equal(counts[0] * counts[0], float(self.communicator.size) * counts[1])
        reduced = tf.cond(even, lambda: summed, lambda: self._sum_weighted_by_rows(grads, variables, dense, [], opt, rows)[0])
        return list(reduced), []

    def unweight(self, grad, total_rows):
        """``P * grad / total_rows``: a sum of row-weighted gradients back to the global mean's
        (0 where nothing was exchanged yet, as for the first steps of bounded staleness)."""
        factor = tf.math.divide_no_nan(tf.cast(self.communicator.size, tf.float32), tf.reshape(total_rows, []))
        return _scaled(grad, factor)

    @abc.abstractmethod
    def _reduce(self, grads, variables, opt):
        """Reduce dense gradients (all present, one per variable); return them in order.

        `opt` is the `OptimizerView` of the optimizer that will apply them.
        """

    def _after_reduce(self, grads, variables, opt):
        """Turn reduced (row-unweighted) dense gradients into what the optimizer should get."""
        return grads

    def replaces_clipping(self, optimizer):
        """True when this reducer clipped gradients itself and Keras must not clip them again."""
        return False

    def _reduce_slices(self, slices, opt):
        """Sum IndexedSlices gradients as the rows they touch, or dense when that is cheaper
        (`tfdp.reducers.sparse`); duplicate rows are kept where `opt` would see them."""
        if not slices:
            return []
        return exchange_slices(self.communicator, slices, self.op, merge_duplicates=opt.linear_in_slices)

    def before_update(self, variables, optimizer=None):
        """Called before every optimizer update (outside any branch Keras takes inside it)."""

    def after_update(self, variables, updated=None):
        """Called after every optimizer update with the updated variables.

        `updated` is None, or under gradient accumulation a boolean tensor: whether this call
        applied the accumulated gradients (False: it only accumulated them).
        """

    def unsettled(self):
        """Whether `settle` has work: the workers' models may differ, or updates are in flight.

        The same answer on every rank (it depends on the steps taken, which every rank takes).
        """
        return False

    def settle(self, apply_gradients, optimizer=None):
        """Finish in-flight work so that every rank holds the same, complete model.

        `apply_gradients(grads, variables, applying=None)` applies already-reduced gradients
        with `applying` (default `optimizer`, the model's). Called on every rank at the end of
        `fit`, before every checkpoint tfdp's callbacks write, and before `evaluate`/`predict`
        outside `fit` when `unsettled`.
        """

    def stats(self):
        """Statistics beyond the communicator's counters (a dict of numbers)."""
        return {"max_staleness": 0}

    def memory_stats(self, optimizer):
        """Bytes this worker holds for `optimizer`: its state, and the reduced gradients of a step."""
        state = sum(variable_bytes(v) for v in optimizer.variables)
        weights = sum(variable_bytes(v) for v in built_variables(optimizer))
        return {"optimizer_state_bytes": state, "sync_optimizer_state_bytes": state,
                "reduced_gradient_bytes": weights, "sync_reduced_gradient_bytes": weights,
                "shard_weight_bytes": 0, "partition": None}


def variable_bytes(variable):
    """The bytes of a variable's value (Keras or TF variable), from its shape and dtype."""
    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


def _dense(grad, variable):
    """`grad` as a dense tensor with its variable's static shape. A gradient that reaches the
    optimizer without one (measured: a Dense kernel's (None, 3) after a masked LSTM's sequences) has the
    variable's shape all the same; the exchange sizes its buffers by static shapes."""
    grad = tf.convert_to_tensor(grad)
    shape = tf.TensorShape(variable.shape)
    if not grad.shape.is_fully_defined() and shape.is_fully_defined():
        grad = tf.reshape(grad, shape)
    return grad


def _scaled(grad, factor, no_nan=False):
    """``grad * factor``; with `no_nan`, 0 where `factor` is 0 even if `grad` is not finite (a rank
    with no rows of a global batch smaller than the workers: batch statistics of nothing are NaN)."""
    multiply = tf.math.multiply_no_nan if no_nan else tf.multiply
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(multiply(grad.values, tf.cast(factor, grad.values.dtype)), grad.indices,
                                grad.dense_shape)
    return multiply(grad, tf.cast(factor, grad.dtype))
