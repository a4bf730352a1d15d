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

`settle` (end of `fit`, before checkpoints) applies what is in flight and averages the
models once, so every rank then holds the same weights, bit for bit.
"""

import collections

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable
from tfdp.reducers.base import GradientReducer, rows_in_this_step
from tfdp.reducers.stale import ExchangePipeline


class DelayedAveraging(GradientReducer):
    """Reducer of `tfdp.AsyncStrategy(staleness=s)`: own step now, the workers' average s steps later.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        staleness: s >= 0 steps between a step and the arrival of its average (0: the
            average replaces the step at once, synchronous model averaging every step).
        delay_seconds: an artificial delay per exchange, for benchmarks.

    Example:
        >>> reducer = DelayedAveraging(communicator, staleness=1)
        >>> grads = reducer.reduce(grads, variables, optimizer)  # this worker's own step
        >>> reducer.after_update(variables)  # hand the step over; swap in step t - 1's average
    """

    description = "delayed averaging (AsyncStrategy)"
    optimizer_state_per_rank = True
    weights_rows = False  # Each worker's step is weighted by its rows when it is averaged.

    def __init__(self, communicator, staleness, delay_seconds=0.0):
        super().__init__(communicator, op="sum")
        self.staleness = staleness
        self.pipeline = ExchangePipeline(communicator, staleness, delay_seconds)
        self._own_steps = collections.deque()  # this worker's steps whose average is in flight
        self._max_staleness = local_variable(tf.constant(0, tf.int64), "tfdp_delayed_max_staleness")
        self._before = None  # the variables' values before the update of the step being traced
        self._variables = None
        self._shapes = None
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
        self._variables = list(variables)
        self._shapes = [(v.shape, v.dtype) for v in self._variables]
        if updated is None:
            self._exchange_step(before)
        else:  # gradient accumulation: only the calls that apply the accumulated gradients
            tf.cond(updated, lambda: self._exchange_step(before), lambda: tf.constant(False))

    def _exchange_step(self, before):
        own = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v) - b, tf.float32), [-1])
                         for v, b in zip(self._variables, before)], axis=0)
        rows = rows_in_this_step()
        rows = tf.constant(1.0) if rows is None else tf.cast(rows, tf.float32)
        weighted = tf.concat([own * rows, tf.reshape(rows, [1])], axis=0)
        correction, age = tf.py_function(self._exchange, [weighted, own], [tf.float32, tf.int64])
        self._max_staleness.assign(tf.maximum(self._max_staleness, age))
        for variable, piece in zip(self._variables, self._split(tf.reshape(correction, tf.shape(own)))):
            variable.assign_add(piece)
        return tf.constant(True)

    def _exchange(self, weighted, own):
        """Eagerly: submit this step; return (average of step t - s minus this worker's step t - s, age)."""
        self._unsettled = True
        summed, age = self.pipeline.step(weighted)
        self._own_steps.append(own)
        if summed is None:
            return tf.zeros_like(own), tf.constant(-1, tf.int64)
        return self._swap(summed), tf.constant(age, tf.int64)

    def _swap(self, summed):
        average = summed[:-1] / summed[-1]
        return average - self._own_steps.popleft()

    def _split(self, vector):
        pieces = tf.split(vector, [s.num_elements() for s, _ in self._shapes])
        return [tf.cast(tf.reshape(p, s), d) for p, (s, d) in zip(pieces, self._shapes)]

    def unsettled(self):
        return self._unsettled

    def settle(self, apply_gradients=None, optimizer=None):
        """Swap in the averages still in flight, then average the models once: every rank equal."""
        if not self._unsettled:
            return
        self._unsettled = False
        for summed in self.pipeline.drain():
            for variable, piece in zip(self._variables, self._split(self._swap(tf.cast(summed, tf.float32)))):
                variable.assign_add(piece)
        # The models now differ only by rounding; one average makes them bit-identical.
        self.communicator.stats.add("rounds", 1)
        averaged = self.communicator.allreduce([tf.convert_to_tensor(v) for v in self._variables], op="average",
                                               gradients=True)
        for variable, value in zip(self._variables, averaged):
            variable.assign(value)
