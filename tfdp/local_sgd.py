"""Local SGD: H local optimizer steps per worker, then one average of the models.

Lin et al., post-local SGD (https://arxiv.org/abs/1808.07217): synchronous warm-up steps,
then local steps. With an outer learning rate or momentum the average becomes an outer
optimizer step on the averaged change, as in DiLoCo (https://arxiv.org/abs/2311.08105).
"""

import tensorflow as tf

from tfdp._state import local_variable
from tfdp.reducers import densify


class LocalSGD:
    """Reducer of `tfdp.AsyncStrategy(sync_every=H)`.

    During the first `warmup_steps` updates gradients are all-reduced every step. After
    that each worker applies its own gradient, and after every H-th local update the
    trainable variables are averaged across workers (one all-reduce of the weights).
    `finish` averages once more at the end of `fit` so every rank ends with the same model.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        sync_every: H >= 1 local steps between averages.
        warmup_steps: synchronous steps first.
        outer_learning_rate, outer_momentum: the outer step applied to the averaged
            change since the last average (Nesterov momentum when > 0). 1.0 and 0.0
            give plain model averaging.
    """

    def __init__(self, communicator, sync_every, warmup_steps=0, outer_learning_rate=1.0,
                 outer_momentum=0.0):
        self.communicator = communicator
        self.sync_every = sync_every
        self.warmup_steps = warmup_steps
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self._step = local_variable(tf.constant(0, tf.int64), "tfdp_local_step")
        self._since_sync = local_variable(tf.constant(0, tf.int64), "tfdp_local_since_sync")
        self._max_staleness = local_variable(tf.constant(0, tf.int64), "tfdp_local_max_staleness")
        self._anchors = None
        self._momenta = None
        self._variables = None

    def max_staleness(self):
        return int(self._max_staleness.numpy())

    def __call__(self, grads):
        grads = [None if g is None else densify(g) for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        stats = self.communicator.stats
        stats.count_step(grads)
        size = self.communicator.size

        def synchronous():
            stats.add("rounds", 1)
            return self.communicator.allreduce([grads[i] for i in present], op="sum", gradients=True)

        def local():
            # Keras divides each worker's loss by the number of workers; undo it so a
            # local step is a full step on this worker's batch.
            return [grads[i] * size for i in present]

        if size == 1:
            reduced = [grads[i] for i in present]
        elif self.warmup_steps > 0:
            reduced = tf.cond(self._step < self.warmup_steps, synchronous, local)
        else:
            reduced = local()
        result = list(grads)
        for i, g in zip(present, reduced):
            result[i] = g
        return result

    def _ensure_anchors(self, variables):
        if self._anchors is None:
            self._variables = list(variables)
            self._anchors = [local_variable(lambda v=v: tf.identity(v), f"tfdp_anchor_{i}")
                             for i, v in enumerate(self._variables)]
            if self.outer_momentum:
                self._momenta = [local_variable(lambda v=v: tf.zeros_like(v), f"tfdp_outer_m_{i}")
                                 for i, v in enumerate(self._variables)]

    def _average(self):
        """Replace every worker's variables by the outer step from the average."""
        stats = self.communicator.stats
        stats.add("rounds", 1)
        averaged = self.communicator.allreduce(
            [tf.convert_to_tensor(v) for v in self._variables], op="average", gradients=True)
        for i, (var, anchor, avg) in enumerate(zip(self._variables, self._anchors, averaged)):
            change = tf.convert_to_tensor(anchor) - avg
            if self.outer_momentum:
                momentum = self._momenta[i]
                momentum.assign(self.outer_momentum * momentum + change)
                change = change + self.outer_momentum * momentum  # Nesterov
            new = tf.convert_to_tensor(anchor) - self.outer_learning_rate * change
            anchor.assign(new)
            var.assign(new)
        self._max_staleness.assign(tf.maximum(self._max_staleness, self._since_sync - 1))
        self._since_sync.assign(0)
        return tf.constant(True)

    def after_update(self, variables):
        """Called by tfdp's optimizer hook after each update: average every H local steps."""
        self._ensure_anchors(variables)
        self._step.assign_add(1)
        if self.communicator.size == 1:
            return
        local_phase = self._step > self.warmup_steps
        since = self._since_sync.assign_add(tf.cast(local_phase, tf.int64))
        tf.cond(local_phase & (since >= self.sync_every), self._average, lambda: tf.constant(False))
        if self.warmup_steps:
            # Synchronous steps keep the anchor at the shared weights.
            tf.cond(local_phase, lambda: tf.constant(False), self._reset_anchors)

    def _reset_anchors(self):
        for var, anchor in zip(self._variables, self._anchors):
            anchor.assign(var)
        return tf.constant(True)

    def finish(self, strategy=None, optimizer=None):
        """Average the models if any local step happened since the last average."""
        if self.communicator.size > 1 and self._anchors is not None and int(self._since_sync.numpy()) > 0:
            self._average()
