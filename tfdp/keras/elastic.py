"""Elastic training on Keras 3: continue `fit` when workers leave or join (horovodrun elastic mode).

Horovod's `KerasState` does not work on Keras 3, and its TensorFlow `run` decorator does not
recognise the grouped all-reduce tfdp uses (a failure there would be swallowed). Here:

- `KerasState(build_model, strategy_factory)` keeps the model, the optimizer state (whole,
  gathered from every worker under ``shard_optimizer_state``) and the epoch in host memory
  (`commit`), rebuilds strategy and model after every change of
  workers (the world size is fixed in a `tf.distribute` strategy), and brings every worker
  to rank 0's committed state (`sync`, by broadcasting the variables: no pickle).
- `run(func)` retries `func(state)` after a worker is lost (the collective fails: the last
  commit is restored) or when hosts are added or removed (at the next commit).
- `CommitEvery(state, batches)` commits every N batches and at every epoch end.

Rule: after a reset the interrupted epoch starts again from its first batch, from the weights
of the last commit (batches after that commit are trained again).

Example (``horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script hosts.sh``)::

    state = tfdp.elastic.KerasState(build_model, tfdp.MirroredStrategy)

    @tfdp.elastic.run
    def train(state):
        state.model.fit(x, y, batch_size=64, epochs=10, initial_epoch=state.epoch,
                        callbacks=[tfdp.elastic.CommitEvery(state, batches=10)])

    train(state)
"""

import functools
import sys

import keras
import numpy as np
import tensorflow as tf

from tfdp._compat.horovod import elastic_run_fn, elastic_state_base, horovod
from tfdp.strategies import MirroredStrategy, watchdog


class KerasState(elastic_state_base()):
    """The state of an elastic Keras `fit`: model, optimizer variables, epoch.

    Args:
        build_model: called with no arguments under a fresh strategy's scope; returns a
            compiled model (the same on every worker).
        strategy_factory: returns a new tfdp strategy (default `tfdp.MirroredStrategy`).
    """

    def __init__(self, build_model, strategy_factory=None):
        hvd = horovod()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self._build_model = build_model
        self._strategy_factory = strategy_factory or MirroredStrategy
        self.strategy = None
        self.model = None
        self.epoch = 0
        self.resets = 0
        self.sizes = []  # the world size of every (re)start, in order
        self._saved = None  # (epoch, model weights, whole optimizer state) as numpy

    def _variables(self):
        optimizer = self.model.optimizer
        if not optimizer.built:
            with self.strategy.scope():
                optimizer.build(self.model.trainable_variables)
        return list(self.model.weights), list(optimizer.variables)

    def _sharded(self):
        return self.strategy.extended.gradient_reducer.shards_optimizer_state

    def optimizer_state(self):
        """The whole optimizer state as numpy arrays, in the order a sync optimizer saves it.

        Under ``shard_optimizer_state`` each worker holds 1/P of it: this gathers it (a
        collective, on every worker), so that a commit survives the loss of any worker and
        loads into another number of workers.
        """
        optimizer = self.model.optimizer
        self._variables()
        if not self._sharded():
            return [np.array(v) for v in optimizer.variables]
        self.strategy.settle(optimizer)
        store = {}
        optimizer.save_own_variables(store)
        return [np.asarray(store[str(i)]) for i in range(len(store))]

    def _load_optimizer_state(self, values):
        optimizer = self.model.optimizer
        if not self._sharded():
            for variable, value in zip(optimizer.variables, values):
                variable.assign(value)
            return
        optimizer.load_own_variables({str(i): value for i, value in enumerate(values)})

    def _rebuild(self):
        # A joining worker builds its first model, the others their second: reset Keras's
        # name counters so every worker creates the same variable names.
        keras.backend.clear_session()
        self.strategy = self._strategy_factory()
        self.sizes.append(self.strategy.num_replicas_in_sync)
        with self.strategy.scope():
            self.model = self._build_model()
        self._variables()

    def save(self):
        weights, _ = self._variables()
        self._saved = (self.epoch, [np.array(v) for v in weights], self.optimizer_state())

    def restore(self):
        if self._saved is not None:
            self.epoch = self._saved[0]

    def reset(self):
        # Horovod was re-initialised with a new world: the old strategy's size is stale.
        self.resets += 1
        self.model = None

    def sync(self):
        if self.model is None:
            self._rebuild()
        weights, _ = self._variables()
        # Every worker (a joining one too) learns the state's shapes from its new model.
        optimizer_state = self.optimizer_state()
        if self._saved is not None:
            _, saved_weights, optimizer_state = self._saved
            for variable, value in zip(weights, saved_weights):
                variable.assign(value)
        communicator = self.strategy.extended.communicator
        for variable in weights:
            variable.assign(communicator.broadcast(tf.convert_to_tensor(variable), root_rank=0))
        self._load_optimizer_state([communicator.broadcast(tf.convert_to_tensor(value), root_rank=0).numpy()
                                    for value in optimizer_state])
        self.epoch = int(communicator.broadcast(tf.constant([self.epoch], tf.int64), root_rank=0).numpy()[0])
        self.save()


class CommitEvery(keras.callbacks.Callback):
    """Commit `state` every `batches` training batches and at the end of every epoch."""

    def __init__(self, state, batches):
        super().__init__()
        if not isinstance(batches, int) or batches < 1:
            raise ValueError(f"`batches` must be an int >= 1. Received: batches={batches!r}")
        self.state = state
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.batches == 0:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
        self.state.commit()


def _is_collective_failure(error):
    text = str(error)
    return "Horovod" in text and ("shut down" in text or "Horovod" in type(error).__name__ or
                                  any(op in text for op in ("Allreduce", "Allgather", "Broadcast")))


def run(func):
    """Run `func(state)`, resuming from the last commit whenever the set of workers changes."""
    run_fn, HorovodInternalError = elastic_run_fn()

    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except (tf.errors.OpError, RuntimeError) as error:
            if not _is_collective_failure(error):
                raise
            # The failed fit never reached on_train_end: stop its watchdog before retrying.
            watchdog.stop_all()
            print(f"tfdp.elastic: a collective failed ({type(error).__name__}); restoring the state "
                  f"of epoch {state._saved[0] if state._saved else 0} and re-forming the job.",
                  file=sys.stderr, flush=True)
            raise HorovodInternalError(error) from error

    def reset():
        hvd = horovod()
        hvd.shutdown()
        hvd.init()

    return run_fn(attempt, reset)
