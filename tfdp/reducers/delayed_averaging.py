"""Delayed averaging: each worker applies its own update at once, the average replaces it s steps later.

Zhou et al., DaSGD (local SGD with delayed averaging, https://arxiv.org/abs/2006.00441).
At step t worker i takes its optimizer's step on its own batch, ``Δ_i(t)``, and hands it to
a background all-reduce; at step t + s the average ``Δ̄(t)`` arrives and the worker swaps
its own step for it: ``w_i += Δ̄(t) - Δ_i(t)``. So

    w_i(t) = w(0) + Σ_{τ ≤ t-s} Δ̄(τ) + Σ_{t-s < τ ≤ t} Δ_i(τ)

Every gradient is computed at the worker's current weights: nothing is stale, the
workers differ only by their last s own steps. The mean of the workers' models moves by
the mean of their steps every step, which under SGD (with momentum) is the synchronous
update, with each gradient taken at its worker's own point. Bounded staleness applied the
summed gradient of step t - s instead, and with momentum that delay is stable only for a
much smaller step (`tfdp.reducers.stale`); here the delay touches only the spread between
workers. The workers' optimizer states are their own (checkpoints keep every rank's).

`settle` (end of `fit`, before checkpoints, before `evaluate` and `predict` outside `fit`)
applies what is in flight and averages the models once, so every rank then holds the same
weights, bit for bit.
"""

import collections
import dataclasses
import functools

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable
from tfdp.reducers.base import GradientReducer, rows_in_this_step, update_group
from tfdp.reducers.stale import ExchangePipeline


@dataclasses.dataclass
class _Updated:
    """One optimizer's variables, and this worker's steps of them whose average is in flight."""

    variables: list
    own_steps: collections.deque = dataclasses.field(default_factory=collections.deque)

    def split(self, vector):
        """`vector` (float32, flat) as one tensor per variable."""
        pieces = tf.split(vector, [v.shape.num_elements() for v in self.variables])
        return [tf.cast(tf.reshape(p, v.shape), v.dtype) for p, v in zip(pieces, self.variables)]

    def swap(self, summed):
        """The average of a step (`summed`: row-weighted steps and the rows) minus this worker's own."""
        return summed[:-1] / summed[-1] - self.own_steps.popleft()


class DelayedAveraging(GradientReducer):
    """Reducer of `tfdp.AsyncStrategy(staleness=s)`: own step now, the workers' average s steps later.

    A model updated by several optimizers (a GAN's two) has each optimizer's steps averaged
    on their own, s of that optimizer's steps later.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        staleness: s >= 0 steps between a step and the arrival of its average (0: the
            average replaces the step at once, synchronous model averaging every step).
        delay_seconds: an artificial delay per exchange, for benchmarks.

    Example:
        >>> reducer = DelayedAveraging(communicator, staleness=1)
        >>> reducer.before_update(variables)
        >>> grads = reducer.reduce(grads, variables, optimizer)  # this worker's own step
        >>> reducer.after_update(variables)  # hand the step over; swap in step t - 1's average
    """

    description = "delayed averaging (AsyncStrategy)"
    optimizer_state_per_rank = True
    weights_rows = False  # Each worker's step is weighted by its rows when it is averaged.
    lockstep = False

    def __init__(self, communicator, staleness, delay_seconds=0.0):
        super().__init__(communicator, op="sum")
        self.staleness = staleness
        self.pipeline = ExchangePipeline(communicator, staleness, delay_seconds)
        self._max_staleness = local_variable(tf.constant(0, tf.int64), "tfdp_delayed_max_staleness")
        self._before = None  # the variables' values before the update being traced
        self._groups = {}  # update group -> _Updated
        self._unsettled = False

    def stats(self):
        return {"max_staleness": int(self._max_staleness.numpy()),
                "blocked_seconds": self.pipeline.blocked_seconds,
                "exchange_seconds": self.pipeline.exchange_seconds}

    def _reduce(self, grads, variables, opt):
        # Keras divided each worker's loss by the number of workers: undo it for a full own step.
        return [g * self.communicator.size for g in grads]

    def before_update(self, variables, optimizer=None):
        """Remember the weights before this worker's step (read before the optimizer writes:
        automatic control dependencies keep program order)."""
        if self.communicator.size > 1:
            self._before = [tf.identity(tf.convert_to_tensor(v)) for v in variables]

    def after_update(self, variables, updated=None):
        """Hand this step to the background average; swap in the average of step t - s."""
        if self._before is None:
            return
        before, self._before = self._before, None
        variables = list(variables)
        group = update_group(variables)
        if group not in self._groups:
            self._groups[group] = _Updated(variables)
        if updated is None:
            self._exchange_step(group, before)
        else:  # gradient accumulation: only the calls that apply the accumulated gradients
            tf.cond(updated, lambda: self._exchange_step(group, before), lambda: tf.constant(False))

    def _exchange_step(self, group, before):
        variables = self._groups[group].variables
        own = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v) - b, tf.float32), [-1])
                         for v, b in zip(variables, before)], axis=0)
        rows = rows_in_this_step()
        rows = tf.constant(1.0) if rows is None else tf.cast(rows, tf.float32)
        weighted = tf.concat([own * rows, tf.reshape(rows, [1])], axis=0)
        correction, age = tf.py_function(functools.partial(self._exchange, group), [weighted, own],
                                         [tf.float32, tf.int64])
        self._max_staleness.assign(tf.maximum(self._max_staleness, age))
        for variable, piece in zip(variables, self._groups[group].split(tf.reshape(correction, tf.shape(own)))):
            variable.assign_add(piece)
        return tf.constant(True)

    def _exchange(self, group, weighted, own):
        """Eagerly: submit this step; return (average of step t - s minus this worker's step t - s, age)."""
        self._unsettled = True
        updated = self._groups[group]
        summed, age = self.pipeline.step(weighted, group)
        updated.own_steps.append(own)
        if summed is None:
            return tf.zeros_like(own), tf.constant(-1, tf.int64)
        return updated.swap(summed), tf.constant(age, tf.int64)

    def unsettled(self):
        return self._unsettled

    def settle(self, apply_gradients=None, optimizer=None):
        """Swap in the averages still in flight, then average the models once: every rank equal."""
        if not self._unsettled:
            return
        self._unsettled = False
        for group, summed in self.pipeline.drain():
            updated = self._groups[group]
            for variable, piece in zip(updated.variables, updated.split(updated.swap(tf.cast(summed, tf.float32)))):
                variable.assign_add(piece)
        # The models now differ only by rounding; one average makes them bit-identical.
        variables = list({id(v): v for g in self._groups.values() for v in g.variables}.values())
        self.communicator.stats.add("rounds", 1)
        averaged = self.communicator.allreduce([tf.convert_to_tensor(v) for v in variables], op="average",
                                               gradients=True)
        for variable, value in zip(variables, averaged):
            variable.assign(value)
