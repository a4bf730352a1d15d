"""Heterogeneity-aware shares: each worker's rows of every global batch follow its speed.

A `Balancer` holds integer weights, one per worker, identical on every rank. A global
batch of ``n`` rows gives each worker with a positive weight one row, then splits the
other ``n - m`` rows (``m`` workers with a positive weight) by cumulative weight with
floor rounding (`share_bounds`): the shares always sum to ``n``, every rank computes
the same ones, and no worker gets 0 rows unless its weight is 0 (or ``n < m``).

Uneven shares keep the one-process trajectory: the gradient reduction weights each rank
by its rows (`tfdp.reducers.base`), synchronized batch norm sums counts across ranks,
and step logs are averaged weighted by each rank's rows of the epoch.

With ``balance="auto"`` each rank times its own compute (from its batch being ready to
its gradients being ready) and counts its rows; every ``interval`` steps the ranks
all-gather those two numbers (one small collective) and set new weights proportional
to rows per second, smoothed, and only when some share is more than ``hysteresis`` (relative)
away from its target, so measurement noise does not make them oscillate.

Example:
    >>> share_bounds(tf.constant(64, tf.int64), tf.constant([7, 3], tf.int64)).numpy().tolist()
    [0, 44, 64]
"""

import keras
import numpy as np
import tensorflow as tf

from tfdp._compat.tensorflow import local_variable

WEIGHT_SCALE = 10_000  # weights are integers: shares in units of 1/10000
DEFAULT_INTERVAL = 20
DEFAULT_HYSTERESIS = 0.05
DEFAULT_SMOOTHING = 0.5


def share_bounds(n, weights):
    """Row boundaries ``[b_0 = 0, ..., b_P = n]`` of a batch of `n` rows (int64 tensors)."""
    n = tf.cast(n, tf.int64)
    weights = tf.cast(weights, tf.int64)
    positive = tf.cast(weights > 0, tf.int64)
    zero = tf.zeros([1], tf.int64)
    guaranteed = tf.minimum(tf.concat([zero, tf.cumsum(positive)], 0), n)
    rest = tf.maximum(n - tf.reduce_sum(positive), 0)
    cumulative = tf.concat([zero, tf.cumsum(weights)], 0)
    return guaranteed + (rest * cumulative) // tf.reduce_sum(weights)


def normalise(weights):
    """Integer weights summing to `WEIGHT_SCALE` from any non-negative numbers (largest remainder)."""
    weights = np.asarray(weights, dtype=np.float64)
    scaled = weights / weights.sum() * WEIGHT_SCALE
    result = np.floor(scaled).astype(np.int64)
    order = np.argsort(-(scaled - result), kind="stable")
    result[order[: WEIGHT_SCALE - result.sum()]] += 1
    return result


def check_balance(balance, size):
    """Validate the ``balance`` argument; return None, ``"auto"`` or integer weights."""
    if balance is None or (isinstance(balance, str) and balance == "auto"):
        return balance
    if isinstance(balance, (list, tuple)) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                  for w in balance):
        if len(balance) != size:
            raise ValueError(f"`balance` has {len(balance)} weights but the job has {size} workers. "
                             f"Pass one weight per worker, e.g. balance={[1] * size}, or balance='auto'.")
        if min(balance) < 0 or sum(balance) <= 0:
            raise ValueError(f"`balance` weights must be >= 0 with a positive sum. Received: balance={balance!r}")
        return normalise(balance)
    raise ValueError("`balance` must be None, 'auto' or a list of one weight per worker (e.g. [0.7, 0.3]). "
                     f"Received: balance={balance!r}")


def next_weights(current, rows, seconds, smoothing=DEFAULT_SMOOTHING, hysteresis=DEFAULT_HYSTERESIS):
    """New integer weights from each worker's measured rows and busy seconds, or `current`.

    Target shares are proportional to rows per second; when some share is more than
    `hysteresis` (relative) away from its target, the shares move `smoothing` of the way there.
    Pure NumPy on identical inputs: every rank gets the same answer.

    Example:
        >>> next_weights([5000, 5000], rows=[320, 320], seconds=[1.0, 2.0]).tolist()
        [5833, 4167]
    """
    current = np.asarray(current, dtype=np.float64)
    rows, seconds = np.asarray(rows, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    active = current > 0
    if np.any(seconds[active] <= 0) or np.any(rows[active] <= 0):
        return np.asarray(current, dtype=np.int64)
    speed = np.where(active, rows / np.where(seconds > 0, seconds, 1.0), 0.0)
    share = current / current.sum()
    target = speed / speed.sum()
    # Hysteresis on the distance to the target (not on the smoothed step), so a share that is
    # more than `hysteresis` off is always corrected, however small each step towards it.
    off = np.abs(target - share)[active] / share[active]
    if np.max(off) <= hysteresis:
        return np.asarray(current, dtype=np.int64)
    return normalise(share + smoothing * (target - share))


class Balancer:
    """The shares of one strategy: the weights, and for ``"auto"`` the timing that sets them."""

    def __init__(self, communicator, balance, interval=DEFAULT_INTERVAL, hysteresis=DEFAULT_HYSTERESIS):
        self.communicator = communicator
        self.auto = isinstance(balance, str) and balance == "auto"
        size = communicator.size
        initial = normalise([1] * size) if self.auto else balance
        self.interval = interval
        self.hysteresis = hysteresis
        self.weights = local_variable(tf.constant(initial, tf.int64), "tfdp_balance_weights")
        self._busy_seconds = local_variable(tf.constant(0.0, tf.float64), "tfdp_balance_busy_seconds")
        self._busy_rows = local_variable(tf.constant(0, tf.int64), "tfdp_balance_busy_rows")
        self.epoch_rows = local_variable(tf.constant(0, tf.int64), "tfdp_balance_epoch_rows")
        self._steps = 0
        self.changes = 0
        self.history = [(0, self.shares())]  # (step, shares) whenever the shares changed
        self.last_speeds = None
        self._started = None

    def shares(self):
        weights = self.weights.numpy()
        return (weights / weights.sum()).tolist()

    def bounds(self, n):
        return share_bounds(n, self.weights)

    def step_started(self, data, rows, timed=True):
        """Inside a step: count this rank's rows; with `timed`, note the time its batch was ready
        and return the batch ordered after that clock reading (TensorFlow runs independent ops
        in any order: without the ordering the reading could come after the forward pass)."""
        self.epoch_rows.assign_add(tf.cast(rows, tf.int64))
        self._started = None
        if not (self.auto and timed):
            return data
        with tf.control_dependencies([t for t in tf.nest.flatten(data) if tf.is_tensor(t)]):
            started = tf.timestamp()
        self._started = (started, tf.cast(rows, tf.int64))
        with tf.control_dependencies([started]):
            return tf.nest.map_structure(lambda t: tf.identity(t) if tf.is_tensor(t) else t, data)

    def gradients_ready(self, grads):
        """Inside a step, when its gradients exist: add the compute time since `step_started`;
        return the gradients ordered after that clock reading, so the exchange waits for it."""
        if not self.auto or self._started is None:
            return grads
        started, rows = self._started
        self._started = None
        ready = [g for g in grads if g is not None]
        with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g for g in ready]):
            now = tf.timestamp()
        self._busy_seconds.assign_add(now - started)
        self._busy_rows.assign_add(rows)
        with tf.control_dependencies([now]):
            return [None if g is None else _identity(g) for g in grads]

    def waited(self, seconds):
        """Inside a step: this rank waited `seconds` for others in a collective (not compute)."""
        self._busy_seconds.assign_sub(seconds)

    def step_ended(self):
        """After each training step (eagerly, on every rank): re-estimate every `interval` steps."""
        self._steps += 1
        if not self.auto:
            return
        if self._steps == 1:  # the first step traces the function: not a measure of speed
            self._busy_rows.assign(0)
            self._busy_seconds.assign(0.0)
        if self._steps % self.interval:
            return
        mine = tf.constant([[float(self._busy_rows.numpy()), float(self._busy_seconds.numpy())]], tf.float64)
        everyone = self.communicator.allgather(mine).numpy()
        self._busy_rows.assign(0)
        self._busy_seconds.assign(0.0)
        self.last_speeds = (everyone[:, 0] / np.maximum(everyone[:, 1], 1e-12)).tolist()
        current = self.weights.numpy()
        # The first estimate goes all the way: equal shares were a guess, not a measurement.
        smoothing = 1.0 if self._steps == self.interval else DEFAULT_SMOOTHING
        new = next_weights(current, everyone[:, 0], everyone[:, 1], smoothing=smoothing, hysteresis=self.hysteresis)
        if not np.array_equal(new, current):
            self.weights.assign(new)
            self.changes += 1
            self.history.append((self._steps, self.shares()))

    def stats(self):
        return {"shares": self.shares(), "speeds_rows_per_second": self.last_speeds, "changes": self.changes,
                "history": [{"step": s, "shares": sh} for s, sh in self.history]}


def _identity(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


class Rebalance(keras.callbacks.Callback):
    """Added by the strategy to `fit` under ``balance="auto"``: re-estimate shares after training steps."""

    def __init__(self, balancer):
        super().__init__()
        self.balancer = balancer

    def on_train_batch_end(self, batch, logs=None):
        self.balancer.step_ended()
