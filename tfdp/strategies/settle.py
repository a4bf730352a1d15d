"""`SettleState`: tfdp's callback that settles reducer state on every rank when it must
(`AgreeOnStopping`, `AgreeOnWeights` and `FilesWritten` close `fit`).

Added by every tfdp strategy to `fit`, `evaluate` and `predict`, before the user's callbacks.
It calls `strategy.settle` (finish in-flight exchanges, gather per-rank reducer state) on
every rank at the end of training and before each checkpoint that ModelCheckpoint or
BackupAndRestore will write, so a checkpoint holds a complete, consistent state: no
stale gradient left in flight, every rank's error-feedback residuals. An `evaluate` or
`predict` outside `fit` first makes the workers' models one, if they may differ (after
`train_on_batch` steps). Validation inside `fit` evaluates the average of the workers'
models where they differ, then every worker goes on training from its own.
"""

import sys

import keras
import tensorflow as tf

from tfdp._compat.keras import checkpoint_callbacks, checkpoint_due


class SettleState(keras.callbacks.Callback):
    """Settle `strategy`'s reducer before checkpoints and at the end of training."""

    def __init__(self, strategy, callbacks):
        super().__init__()
        self.strategy = strategy
        self.checkpointers = checkpoint_callbacks(callbacks)
        self._training = False
        self._own_weights = None

    def on_train_begin(self, logs=None):
        self._training = True

    def on_test_begin(self, logs=None):
        if not self._training:
            self.strategy.settle_before_inference(self.model)
        else:
            self._own_weights = self.strategy.average_for_validation(self.model)

    def on_test_end(self, logs=None):
        if self._own_weights is not None:
            for variable, own in self._own_weights:
                variable.assign(own)
            self._own_weights = None

    def on_predict_begin(self, logs=None):
        self.strategy.settle_before_inference(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if any(checkpoint_due(c, batch) for c in self.checkpointers):
            self.strategy.settle(self.model.optimizer)

    def on_epoch_end(self, epoch, logs=None):
        if any(checkpoint_due(c) for c in self.checkpointers):
            self.strategy.settle(self.model.optimizer)

    def on_train_end(self, logs=None):
        self._training = False
        self.strategy.settle(self.model.optimizer)


class AgreeOnStopping(keras.callbacks.Callback):
    """Stop training on every rank when a callback stopped it on one.

    A callback of the user's may set `model.stop_training` from what only its rank sees (a
    wall-clock budget, a file, a signal). Keras then ends `fit` on that rank alone, and the
    others waited in their next step's all-reduce until the step watchdog ended the job
    (120 s). tfdp adds this callback after the user's when one of them runs code of its own
    that may set the flag (`may_stop_training_at`): one small all-gather of the flag after each
    batch (code at batch or epoch begin, or batch end) or after each epoch (code at epoch end);
    all ranks stop where any asked to, and the ranks that did not ask say so on stderr. Keras's
    own callbacks decide on the global logs, the same on every rank, and cost nothing; so do
    callbacks whose source never names ``stop_training`` (progress bars, timers).
    """

    def __init__(self, communicator, each_batch, each_epoch, watchdog):
        super().__init__()
        self.communicator = communicator
        self.each_batch, self.each_epoch = each_batch, each_epoch
        self.watchdog = watchdog  # a rank stalled in its own callback leaves the others waiting here
        self._epoch, self._batch = 0, 0

    def _agree(self, where):
        asked = bool(getattr(self.model, "stop_training", False))
        with self.watchdog.watching(self._batch):
            flags = self.communicator.allgather(tf.constant([int(asked)], tf.int32)).numpy().tolist()
        if any(flags) and not asked:
            ranks = [r for r, flag in enumerate(flags) if flag]
            print(f"tfdp: rank {self.communicator.rank} stops training {where}: a callback set "
                  f"model.stop_training on rank(s) {ranks}, and every rank stops with them.", file=sys.stderr)
        self.model.stop_training = any(flags)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._batch = batch
        if self.each_batch:
            self._agree(f"after batch {batch} of epoch {self._epoch}")

    def on_epoch_end(self, epoch, logs=None):
        if self.each_epoch:
            self._agree(f"after epoch {epoch}")


class AgreeOnWeights(keras.callbacks.Callback):
    """After the user's callbacks have ended training, make sure every rank holds the same model.

    A callback may replace the weights when training ends: `EarlyStopping(restore_best_weights=True)`
    restores the weights it copied at the best epoch, and where the workers apply their own steps
    (delayed averaging, local residuals, local SGD) each rank copied its own. tfdp adds this
    callback after the user's: one small all-gather of each trainable variable's sum and sum of
    squares tells whether the ranks differ, and only then are they averaged. Non-trainable state
    is left alone: batch norm's moving statistics are each rank's own, as under tf.distribute.
    Where every worker applies the same updates (sync, stale gradients) the copies cannot differ
    and nothing is checked.
    """

    def __init__(self, communicator, reducer):
        super().__init__()
        self.communicator = communicator
        self.reducer = reducer

    def on_train_end(self, logs=None):
        if not self.reducer.optimizer_state_per_rank:
            return
        variables = [v for v in self.model.trainable_weights if keras.backend.is_float_dtype(v.dtype)]
        if not variables:
            return
        values = [tf.convert_to_tensor(v) for v in variables]
        sums = tf.stack([tf.reduce_sum(tf.cast(x, tf.float64)) for x in values]
                        + [tf.reduce_sum(tf.square(tf.cast(x, tf.float64))) for x in values])
        gathered = self.communicator.allgather(sums[None]).numpy()
        if (gathered == gathered[0]).all():
            return
        averaged = self.communicator.allreduce(values, op="average")
        for variable, value in zip(variables, averaged):
            variable.assign(value)


class FilesWritten(keras.callbacks.Callback):
    """Return from `fit` on no rank before rank 0 has written its files.

    tfdp lets rank 0 alone write ModelCheckpoint, BackupAndRestore, TensorBoard and CSVLogger
    files. A script that reads them back after `fit` on every rank (the best checkpoint,
    `keras.models.load_model`) found nothing on rank 1 while rank 0 was still writing. Added
    last, after the user's callbacks, when one of them writes: one small all-reduce, as a barrier.
    """

    def __init__(self, communicator):
        super().__init__()
        self.communicator = communicator

    def on_train_end(self, logs=None):
        self.communicator.allreduce([tf.zeros([1])], op="sum")
