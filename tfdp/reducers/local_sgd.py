"""Local SGD: H local optimizer steps per worker, then one average of the models.

Lin et al., post-local SGD (https://arxiv.org/abs/1808.07217): synchronous warm-up steps,
then local steps. With an outer learning rate or momentum the average becomes an outer
optimizer step on the averaged change, as in DiLoCo (https://arxiv.org/abs/2311.08105).
"""

import dataclasses

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable
from tfdp.reducers.base import GradientReducer, update_group, variable_key


class LocalSGD(GradientReducer):
    """Reducer of `tfdp.AsyncStrategy(sync_every=H)`.

    During the first `warmup_steps` updates gradients are all-reduced every step. After
    that each worker applies its own gradient, and after every H-th local update the
    trainable variables are averaged across workers (one all-reduce of the weights).
    `settle` averages once more (at the end of `fit`, and before a checkpoint) so every
    rank holds the same model. The step counters, anchors and outer momenta are reducer
    state, saved with the optimizer. A model updated by several optimizers (a GAN's two)
    has each optimizer's steps counted, and its variables averaged, on their own.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        sync_every: H >= 1 local steps between averages.
        warmup_steps: synchronous steps first.
        outer_learning_rate, outer_momentum: the outer step applied to the averaged
            change since the last average (Nesterov momentum when > 0). 1.0 and 0.0
            give plain model averaging.
    """

    rounds_per_step = 0  # Rounds are counted where they happen: sync steps and averages.
    description = "local SGD (AsyncStrategy)"
    optimizer_state_per_rank = True
    lockstep = False

    def __init__(self, communicator, sync_every, warmup_steps=0, outer_learning_rate=1.0,
                 outer_momentum=0.0):
        super().__init__(communicator, op="sum")
        self.sync_every = sync_every
        self.warmup_steps = warmup_steps
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self._max_staleness = local_variable(tf.constant(0, tf.int64), "tfdp_local_max_staleness")
        self._groups = {}  # update group -> _Averaged, in order of first update
        self._current = None  # the group of the update being traced

    def stats(self):
        return {"max_staleness": int(self._max_staleness.numpy())}

    def before_update(self, variables, optimizer=None):
        """Find (or start) the counters of the optimizer whose update this is."""
        variables = list(variables)
        group = update_group(variables)
        if group not in self._groups:
            # Created in this order on every rank. The first group keeps the names of
            # checkpoints written before models with several optimizers were supported.
            n = len(self._groups)
            suffix = "" if n == 0 else f"_{n}"
            self._groups[group] = _Averaged(
                variables, self.state.variable(f"local_sgd_step{suffix}", lambda: tf.constant(0, tf.int64)),
                self.state.variable(f"local_sgd_since_sync{suffix}", lambda: tf.constant(0, tf.int64)))
            for var in variables:
                self._anchor(var)
                if self.outer_momentum:
                    self._momentum(var)
        self._current = self._groups[group]

    def _reduce(self, grads, variables, opt):
        size = self.communicator.size

        def synchronous():
            self.communicator.stats.add("rounds", 1)
            return self.communicator.allreduce(grads, op="sum", gradients=True)

        def local():
            # Keras divides each worker's loss by the number of workers; undo it so a
            # local step is a full step on this worker's batch.
            return [g * size for g in grads]

        if size == 1:
            return grads
        if self.warmup_steps > 0:
            return tf.cond(self._current.step < self.warmup_steps, synchronous, local)
        return local()

    def _anchor(self, variable):
        return self.state.variable(f"{variable_key(variable)}/anchor", lambda: tf.identity(variable))

    def _momentum(self, variable):
        return self.state.variable(f"{variable_key(variable)}/outer_momentum", lambda: tf.zeros_like(variable))

    def _average(self, group):
        """Replace every worker's variables of `group` by the outer step from their average."""
        self.communicator.stats.add("rounds", 1)
        averaged = self.communicator.allreduce(
            [tf.convert_to_tensor(v) for v in group.variables], op="average", gradients=True)
        for var, avg in zip(group.variables, averaged):
            anchor = self._anchor(var)
            change = tf.convert_to_tensor(anchor) - avg
            if self.outer_momentum:
                momentum = self._momentum(var)
                momentum.assign(self.outer_momentum * momentum + change)
                change = change + self.outer_momentum * momentum  # Nesterov
            new = tf.convert_to_tensor(anchor) - self.outer_learning_rate * change
            anchor.assign(new)
            var.assign(new)
        self._max_staleness.assign(tf.maximum(self._max_staleness, group.since_sync - 1))
        group.since_sync.assign(0)
        return tf.constant(True)

    def _reset_anchors(self, group):
        for var in group.variables:
            self._anchor(var).assign(var)
        return tf.constant(True)

    def after_update(self, variables, updated=None):
        """Count the update; average every H local steps (under gradient accumulation, count
        only the calls that applied the accumulated gradients)."""
        group = self._current
        if updated is None:
            self._count_update(group)
        else:
            tf.cond(updated, lambda: self._count_update(group), lambda: tf.constant(False))

    def _count_update(self, group):
        group.step.assign_add(1)
        if self.communicator.size == 1:
            return tf.constant(True)
        local_phase = group.step > self.warmup_steps
        since = group.since_sync.assign_add(tf.cast(local_phase, tf.int64))
        tf.cond(local_phase & (since >= self.sync_every), lambda: self._average(group), lambda: tf.constant(False))
        if self.warmup_steps:
            # Synchronous steps keep the anchor at the shared weights.
            tf.cond(local_phase, lambda: tf.constant(False), lambda: self._reset_anchors(group))
        return tf.constant(True)

    def _local_groups(self):
        return [g for g in self._groups.values() if int(g.since_sync.numpy()) > 0]

    def unsettled(self):
        return self.communicator.size > 1 and bool(self._local_groups())

    def settle(self, apply_gradients=None, optimizer=None):
        """Average the models of every optimizer that took local steps since its last average."""
        if self.communicator.size > 1:
            for group in self._local_groups():
                self._average(group)


@dataclasses.dataclass
class _Averaged:
    """One optimizer's variables and its counters (reducer state, so checkpoints keep them)."""

    variables: list
    step: object
    since_sync: object
