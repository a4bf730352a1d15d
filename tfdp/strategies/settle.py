"""`SettleState`: tfdp's callback that settles reducer state on every rank when it must.

Added by every tfdp strategy to `fit`, `evaluate` and `predict`, before the user's callbacks.
It calls `strategy.settle` (finish in-flight exchanges, gather per-rank reducer state) on
every rank at the end of training and before each checkpoint that ModelCheckpoint or
BackupAndRestore will write, so a checkpoint holds a complete, consistent state: no
stale gradient left in flight, every rank's error-feedback residuals. An `evaluate` or
`predict` outside `fit` first makes the workers' models one, if they may differ (after
`train_on_batch` steps); validation inside `fit` runs each worker's own model.
"""

import keras

from tfdp._compat.keras import checkpoint_callbacks, checkpoint_due


class SettleState(keras.callbacks.Callback):
    """Settle `strategy`'s reducer before checkpoints and at the end of training."""

    def __init__(self, strategy, callbacks):
        super().__init__()
        self.strategy = strategy
        self.checkpointers = checkpoint_callbacks(callbacks)
        self._training = False

    def on_train_begin(self, logs=None):
        self._training = True

    def on_test_begin(self, logs=None):
        if not self._training:
            self.strategy.settle_before_inference(self.model)

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
