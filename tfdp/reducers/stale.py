"""Bounded-staleness gradient exchange: all-reduce in the background, apply s steps later.

At step t a worker hands its gradient to a background thread, which all-reduces the
gradients in step order (each rank submits the same sequence, so Horovod pairs them), and
the step then applies the globally summed gradient of step t - s, waiting for it if it is
not there yet. That wait is the bound: no worker ever applies a
gradient older than s steps, and a worker can run at most s steps ahead of the slowest
one. Every rank applies the same sequence of summed gradients, so weights stay identical.
"""

import collections
import dataclasses
import functools
import threading
import time

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable
from tfdp.reducers.base import ROW_COUNT, GradientReducer, update_group, variable_key
from tfdp.reducers.optimizer_view import gradient_for_momentum, next_momentum_buffer
from tfdp.reducers.optimizer_view import view as optimizer_view

WAIT_TIMEOUT_SECONDS = 600


class ExchangePipeline:
    """A background thread that all-reduces submitted float32 vectors in order.

    Submissions may belong to groups (one per optimizer of a model that has several): a step
    returns the sum of its own group's submission s steps of that group earlier. Every rank
    submits in the same order, so the background all-reduces pair across ranks.

    Example:
        >>> pipeline = ExchangePipeline(communicator, staleness=1)
        >>> applied, age = pipeline.step(local_gradient)  # the sum of step t - 1, or None
    """

    def __init__(self, communicator, staleness, delay_seconds=0.0):
        self.communicator = communicator
        self.staleness = staleness
        self.delay_seconds = delay_seconds
        self.blocked_seconds = 0.0
        self.exchange_seconds = 0.0
        self.exchanges = 0
        self._submitted = 0
        self._waiting = {}  # group -> indices of its submissions not yet returned, oldest first
        self._pending = collections.deque()
        self._results = {}
        self._error = None
        self._condition = threading.Condition()
        self._thread = None

    def _ensure_thread(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="tfdp-exchange", daemon=True)
            self._thread.start()

    def _run(self):
        while True:
            with self._condition:
                while not self._pending:
                    self._condition.wait()
                index, vector = self._pending.popleft()
            if index is None:
                return
            start = time.monotonic()
            try:
                if self.delay_seconds:
                    time.sleep(self.delay_seconds)  # Benchmarks only: an emulated slow link.
                vector = self.communicator.allreduce_in_background(vector, gradients=True)
                with self._condition:
                    self._results[index] = vector
                    self.exchange_seconds += time.monotonic() - start
                    self.exchanges += 1
                    self._condition.notify_all()
            except Exception as err:  # noqa: BLE001 - surfaced in the training thread.
                with self._condition:
                    self._error = err
                    self._condition.notify_all()
                return

    def _wait_for(self, index):
        start = time.monotonic()
        with self._condition:
            while index not in self._results:
                if self._error is not None:
                    raise RuntimeError(f"tfdp: the background gradient exchange failed: {self._error}")
                if time.monotonic() - start > WAIT_TIMEOUT_SECONDS:
                    raise RuntimeError(
                        f"tfdp: no summed gradient for step {index} after {WAIT_TIMEOUT_SECONDS} s; "
                        "a worker has stopped or is far behind."
                    )
                self._condition.wait(timeout=1.0)
            self.blocked_seconds += time.monotonic() - start
            return self._results.pop(index)

    def step(self, vector, group=None):
        """Submit this step's vector; return (the sum of `group`'s step t - s or None, its age in steps).

        `vector` is an eager tensor: immutable, so the thread can hold it without a copy.
        """
        self._ensure_thread()
        with self._condition:
            index = self._submitted
            self._pending.append((index, vector))
            self._submitted += 1
            self._condition.notify_all()
        waiting = self._waiting.setdefault(group, collections.deque())
        waiting.append(index)
        if len(waiting) <= self.staleness:
            return None, 0
        age = len(waiting) - 1
        return self._wait_for(waiting.popleft()), age

    @property
    def submitted(self):
        """Exchanges submitted so far."""
        return self._submitted

    def in_flight(self):
        """Submitted exchanges not yet returned by `step` or `drain`."""
        return sum(len(waiting) for waiting in self._waiting.values())

    def drain(self):
        """Wait for every submitted exchange; return ``(group, sum)`` of those not yet returned, in
        the order they were submitted."""
        remaining = sorted((index, group) for group, waiting in self._waiting.items() for index in waiting)
        self._waiting = {}
        return [(group, self._wait_for(index)) for index, group in remaining]


@dataclasses.dataclass
class _Exchanged:
    """What `settle` needs to apply one optimizer's gradients still in flight."""

    variables: list
    shapes: list
    weighted: bool  # the last entry is the step's row count
    optimizer: object


class StaleGradients(GradientReducer):
    """Reducer of `tfdp.AsyncStrategy(staleness=s)`: apply the summed gradient of step t - s.

    For the first s steps of each `fit` nothing is applied; `settle` (at the end of `fit`
    and before every checkpoint) applies the summed gradients still in flight, in order,
    so no gradient is lost and a checkpoint never leaves one behind.

    Staleness acts like extra momentum (Mitliagkas et al., "Asynchrony begets momentum",
    https://arxiv.org/abs/1605.09774), so under SGD with momentum mu the explicit momentum
    can be lowered: with ``momentum`` set, the optimizer's own momentum is steered to step
    as if it were that value (``"auto"``: ``staleness_momentum(mu, s)``), without touching
    the optimizer (see `tfdp.reducers.optimizer_view`).

    Args:
        communicator: a `tfdp.comm.Communicator`.
        staleness: s >= 0; 0 is synchronous.
        damping: None, or ``"lr"`` to scale each applied gradient by 1 / (1 + age).
        delay_seconds: an artificial delay per exchange, for benchmarks.
        momentum: None (the optimizer's own), ``"auto"``, or a momentum in [0, 1) for
            momentum SGD under staleness.
    """

    supports_accumulation = False
    description = "bounded-staleness exchange (AsyncStrategy)"
    lockstep = False

    def __init__(self, communicator, staleness, damping=None, delay_seconds=0.0, momentum=None):
        super().__init__(communicator, op="sum")
        self.staleness = staleness
        self.damping = damping
        self.momentum = momentum
        self.pipeline = ExchangePipeline(communicator, staleness, delay_seconds)
        self._max_staleness = local_variable(tf.constant(0, tf.int64), "tfdp_max_staleness")
        self._groups = {}  # update group -> _Exchanged
        self._optimizer = None  # the optimizer of the update being traced

    def stats(self):
        return {"max_staleness": int(self._max_staleness.numpy()),
                "blocked_seconds": self.pipeline.blocked_seconds,
                "exchange_seconds": self.pipeline.exchange_seconds}

    def _exchange(self, group, vector):
        applied, age = self.pipeline.step(vector, group)
        if applied is None:
            return tf.zeros_like(vector), tf.constant(-1, tf.int64)
        return applied, tf.constant(age, tf.int64)

    def before_update(self, variables, optimizer=None):
        self._optimizer = optimizer

    def _reduce(self, grads, variables, opt):
        # With row weighting the last entry is this step's row count; it travels (and is
        # delayed) with the gradients, so `settle` can unweight what it applies.
        weighted = variables[-1] is ROW_COUNT
        own = [v for v in variables if v is not ROW_COUNT]
        group = update_group(own)
        exchanged = self._groups[group] = _Exchanged(own, [(g.shape, g.dtype) for g in grads], weighted,
                                                     self._optimizer)
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads], axis=0)
        # py_function hands the step's tensor to Python without a copy; the exchange
        # runs outside this graph, so it can outlive the step.
        applied, age = tf.py_function(functools.partial(self._exchange, group), [flat], [tf.float32, tf.int64])
        applied = tf.reshape(applied, tf.shape(flat))
        self._max_staleness.assign(tf.maximum(self._max_staleness, age))
        applied = _unflatten(applied, exchanged.shapes)
        if self.damping == "lr":
            damped = len(applied) - (1 if weighted else 0)  # not the row count
            scale = 1 / tf.cast(1 + tf.maximum(age, 0), tf.float32)
            applied = [g * tf.cast(scale, g.dtype) for g in applied[:damped]] + applied[damped:]
        return applied

    def _target_momentum(self, opt):
        if self.momentum is None or opt.momentum == 0:
            return None
        target = staleness_momentum(opt.momentum, self.staleness) if self.momentum == "auto" else self.momentum
        return None if target == opt.momentum else target

    def _after_reduce(self, grads, variables, opt):
        target = self._target_momentum(opt)
        if target is None:
            return grads
        steered = []
        for grad, variable in zip(grads, variables):
            buffer = self.state.variable(f"{variable_key(variable)}/optimizer_momentum",
                                         lambda v=variable: tf.zeros(v.shape, v.dtype))
            grad = gradient_for_momentum(grad, buffer, opt, target)
            buffer.assign(next_momentum_buffer(buffer, grad, opt))
            steered.append(grad)
        return steered

    def unsettled(self):
        return self.pipeline.in_flight() > 0

    def settle(self, apply_gradients, optimizer=None):
        """Apply the summed gradients still in flight, in order, each with its own optimizer."""
        scale = 1.0 / (1 + self.staleness) if self.damping == "lr" else 1.0
        for group, vector in self.pipeline.drain():
            exchanged = self._groups[group]
            grads = _unflatten(tf.cast(vector, tf.float32), exchanged.shapes)
            if exchanged.weighted:
                *grads, total = grads
                grads = [self.unweight(g, total) for g in grads]
            applying = exchanged.optimizer or optimizer
            grads = self._after_reduce([g * scale for g in grads], exchanged.variables, optimizer_view(applying))
            apply_gradients(grads, exchanged.variables, applying)


def _unflatten(vector, shapes):
    pieces = tf.split(vector, [s.num_elements() for s, _ in shapes])
    return [tf.cast(tf.reshape(p, s), d) for p, (s, d) in zip(pieces, shapes)]


def staleness_momentum(momentum, staleness):
    """The explicit momentum for SGD momentum `momentum` under `staleness` steps of delay.

    ``1 - (1 - momentum) * (1 + s**2)``, at least 0: 0.9 becomes 0.8 at s=1 and 0.5 at s=2.
    Delay adds momentum of its own (Mitliagkas et al.), so the explicit one must shrink;
    by how much is an empirical fit: on digits (MLP, SGD 0.05 with momentum 0.9, global
    batch 64, 12 epochs, 2 workers, 2 seeds) the best of {0.9, 0.8, 0.5, 0.3, 0} was 0.8
    at s=1 (+0.56 pp against sync) and 0.5 at s=2 (-0.56 pp); the rule that keeps
    ``(1 - mu') / (1 - mu)`` at 1 + s (0.8, 0.7) gave -1.67 pp at s=2. `benchmarks/preset_grid.py`
    measures it on other configurations.

    Example:
        >>> round(staleness_momentum(0.9, 2), 3)
        0.5
    """
    return max(0.0, 1 - (1 - momentum) * (1 + staleness ** 2))
