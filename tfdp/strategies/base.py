"""`HorovodStrategy`: the set-up shared by all tfdp strategies; subclasses choose the reducer."""

import os
import socket
import sys

import numpy as np
import tensorflow as tf

from tfdp import _compat
from tfdp._compat.horovod import cross_size
from tfdp._compat.keras import (BATCH_HOOKS, EPOCH_HOOKS, gradients_reduced, may_stop_training_at,
                                note_multi_worker_strategy, writes_on_rank_0_only)
from tfdp._compat.tensorflow import global_seed, local_variable
from tfdp.comm import HorovodCommunicator
from tfdp.strategies import output
from tfdp.strategies.balance import Balancer, Rebalance, check_balance
from tfdp.strategies.epoch_logs import GlobalEpochLogs
from tfdp.strategies.extended import HorovodExtended
from tfdp.strategies.settle import AgreeOnStopping, AgreeOnWeights, FilesWritten, SettleState
from tfdp.strategies.watchdog import StepWatchdog, lost_hosts, timeout_from_env


class HorovodStrategy(tf.distribute.Strategy):
    """Shared set-up of the tfdp strategies; `make_reducer(communicator)` gives the reducer."""

    _collective_key_base = 0  # Read by MirroredExtended.__init__; tfdp uses no TF collectives.

    def __init__(self, make_reducer, global_step_logs=True, skip_nonfinite=False, balance=None):
        _compat.install()
        for name, value in (("global_step_logs", global_step_logs), ("skip_nonfinite", skip_nonfinite)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
        communicator = HorovodCommunicator()
        reducer = make_reducer(communicator)
        balancer = self._balancer(balance, communicator, reducer)
        super().__init__(HorovodExtended(self, communicator, reducer, global_step_logs, balancer))
        self._step_timeout_seconds = timeout_from_env()  # A bad value fails here, on every rank.
        if skip_nonfinite:
            self.extended.skipped_steps = local_variable(lambda: tf.constant(0, tf.int64), "tfdp_skipped_steps")
        if communicator.size > 1:
            self._share_random_seed(communicator)
            note_multi_worker_strategy(self)
        self._hosts = self._gather_hosts() if cross_size() > 1 else None
        output.follow_rank(communicator.rank, communicator.size)

    @staticmethod
    def _balancer(balance, communicator, reducer):
        weights = check_balance(balance, communicator.size)
        if weights is None:
            return None
        if not reducer.weights_rows:
            raise ValueError(
                f"balance={balance!r} needs a gradient exchange that weights each worker by its rows; "
                f"tfdp's {reducer.description} does not (error feedback keeps residuals across steps, and "
                "asynchronous exchanges apply gradients later). Use tfdp.MirroredStrategy(balance=...), or "
                "CompressedStrategy with error_feedback=False.")
        return None if communicator.size == 1 else Balancer(communicator, weights)

    def balance_stats(self):
        """The shares of every global batch (``balance``): current shares, measured speeds, changes.

        Returns:
            dict with ``shares`` (one fraction per worker), ``speeds_rows_per_second``
            (each worker's measured rows per second of compute at the last estimate, or
            None), ``changes`` (how often the shares changed) and ``history`` (step and
            shares at each change); None without ``balance``.
        """
        balancer = self.extended.balancer
        return None if balancer is None else balancer.stats()

    @staticmethod
    def _share_random_seed(communicator):
        # Keras shuffles `fit` inputs with TF's global seed; ranks must draw the same
        # permutation or the global batches would not partition the data. A seed the
        # user set (before or after this) is kept; with none, rank 0's random one is shared.
        if global_seed() is not None:
            return
        seed = tf.constant([np.random.SeedSequence().entropy % (2**31)], tf.int64)
        tf.random.set_seed(int(communicator.broadcast(seed, root_rank=0).numpy()[0]))

    def _gather_hosts(self):
        """Every rank's host name (jobs that span hosts), so the watchdog can name a lost one."""
        return self.extended._gather_strings(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())

    @property
    def rank(self):
        """This worker's Horovod rank."""
        return self.extended.rank

    @property
    def is_chief(self):
        """True on rank 0, the worker that prints and writes files."""
        return self.extended.is_chief

    @property
    def gradient_reducer(self):
        """The `tfdp.reducers.GradientReducer` that exchanges this strategy's gradients."""
        return self.extended.gradient_reducer

    def communication_stats(self):
        """Return what this worker handed to collectives since the strategy was created.

        Returns:
            dict with ``steps`` (gradient exchanges), ``collectives`` (collective
            calls), ``payload_bytes`` (bytes handed to collectives, all of them),
            ``gradient_bytes`` (the part that carried gradients), ``dense_bytes`` (what
            the exchanged gradients are as float32), ``rounds``, ``max_staleness`` and
            any statistics of the strategy's reducer.
        """
        stats = self.extended.communicator.stats.as_dict()
        stats.update(self.gradient_reducer.stats())
        return stats

    def memory_stats(self, optimizer):
        """Bytes this worker holds for `optimizer` (built), counted from its actual variables.

        Returns:
            dict with ``optimizer_state_bytes`` (every variable of the optimizer on this
            worker), ``sync_optimizer_state_bytes`` (what it would be without
            ``shard_optimizer_state``), ``reduced_gradient_bytes`` /
            ``sync_reduced_gradient_bytes`` (the reduced gradients of one step), and
            ``shard_weight_bytes`` (this worker's copies of its shard of the weights).

        Example:
            >>> strategy.memory_stats(model.optimizer)["optimizer_state_bytes"]
        """
        return self.gradient_reducer.memory_stats(optimizer)

    def training_callbacks(self, model=None, callbacks=()):
        """Callbacks tfdp adds (first, on every rank) to `fit`, `evaluate` and `predict`."""
        extra = [SettleState(self, callbacks)]
        if not self.extended.global_step_logs and self.extended.communicator.size > 1:
            extra.append(GlobalEpochLogs(self.extended.communicator))
        if self.extended.balancer is not None and self.extended.balancer.auto:
            extra.append(Rebalance(self.extended.balancer))
        if self.extended.communicator.size > 1:
            # `closing_callbacks`, called next for the same callback list, watches its collectives with it.
            self._watchdog = StepWatchdog(self.rank, self._step_timeout_seconds, self._hosts)
            extra.append(self._watchdog)
        return extra

    def closing_callbacks(self, model=None, callbacks=()):
        """Callbacks tfdp adds (last, on every rank) to `fit`, `evaluate` and `predict`, after the
        user's `callbacks`."""
        communicator = self.extended.communicator
        if communicator.size == 1:
            return []
        closing = [AgreeOnWeights(communicator, self.gradient_reducer)]
        each_batch = bool(may_stop_training_at(callbacks, BATCH_HOOKS))
        each_epoch = bool(may_stop_training_at(callbacks, EPOCH_HOOKS))
        if each_batch or each_epoch:
            closing.insert(0, AgreeOnStopping(communicator, each_batch, each_epoch, self._watchdog))
        if writes_on_rank_0_only(callbacks):
            closing.append(FilesWritten(communicator))
        return closing

    def step_failed(self, error):
        """A training or test step raised `error`: on a job that spans hosts, name the hosts that no longer answer."""
        lost = lost_hosts(self._hosts, self.rank)
        if lost:
            print(f"tfdp: rank {self.rank} on host {self._hosts[self.rank]}: a step failed "
                  f"({type(error).__name__}): {lost}.", file=sys.stderr, flush=True)

    def settle(self, optimizer):
        """Finish in-flight exchanges and gather every rank's reducer state.

        Call it on every rank (it runs collectives) before saving a model by hand on rank
        0, so the file holds a complete state; tfdp calls it before each checkpoint its
        callbacks write and at the end of `fit`.
        """

        reducer = self.gradient_reducer
        self._finish_in_flight(optimizer)
        if reducer.optimizer_state_per_rank and optimizer.built:
            reducer.state.capture(optimizer)
        reducer.state.snapshot()

    def settle_before_inference(self, model):
        """Outside `fit`, before `evaluate`/`predict` (and their `*_on_batch`): where the workers'
        models may differ (steps taken with `train_on_batch` under an asynchronous or local-residual
        preset), make them one. A collective, run on every rank; the same decision on each."""
        optimizer = getattr(model, "optimizer", None)  # a model never compiled has no attribute
        if optimizer is not None and self.gradient_reducer.unsettled():
            self._finish_in_flight(optimizer)

    def average_for_validation(self, model):
        """Inside `fit`, where the workers' models differ: give every rank their average for
        validation (one all-reduce of the trainable weights, counted in ``payload_bytes``, not
        as gradient bytes) and return ``(variable, this rank's own value)`` pairs to restore
        after it; None where the models are the same."""
        reducer = self.gradient_reducer
        if self.extended.communicator.size == 1 or not (reducer.optimizer_state_per_rank and reducer.unsettled()):
            return None
        variables = list(model.trainable_weights)
        own = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        for variable, average in zip(variables, self.extended.communicator.allreduce(own, op="average")):
            variable.assign(average)
        return list(zip(variables, own))

    def _finish_in_flight(self, optimizer):
        def apply_gradients(grads, variables, applying=None):
            with gradients_reduced():
                self.run((applying or optimizer).apply, args=(grads, variables))

        self.gradient_reducer.settle(apply_gradients, optimizer)

    def skipped_steps(self):
        """Steps skipped on every rank because a reduced gradient was not finite (``skip_nonfinite``)."""
        counter = self.extended.skipped_steps
        return 0 if counter is None else int(counter.numpy())
