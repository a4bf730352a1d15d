"""Keras 3 versions of Horovod's callbacks, for `fit` without a tfdp strategy.

Under a tfdp strategy none of them is needed: variables start from rank 0's values
and reported metrics are already global.
"""

import keras
import tensorflow as tf

from tfdp._compat.keras import bound_reducer
from tfdp.comm import HorovodCommunicator
from tfdp.strategies import HorovodStrategy

__all__ = ["BroadcastGlobalVariables", "CommunicationLogger", "MetricAverage", "LearningRateWarmup"]


class BroadcastGlobalVariables(keras.callbacks.Callback):
    """Copy rank `root_rank`'s model and optimizer variables to every worker when training starts.

    Example:
        >>> model.fit(x, y, callbacks=[tfdp.callbacks.BroadcastGlobalVariables()])
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self._communicator = HorovodCommunicator()

    def on_train_begin(self, logs=None):
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            if not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
            variables += list(self.model.optimizer.variables)
        for variable in variables:
            variable.assign(self._communicator.broadcast(tf.convert_to_tensor(variable), self.root_rank))


class MetricAverage(keras.callbacks.Callback):
    """Replace each epoch's logged metrics by their average over workers.

    Put it before callbacks that read the logs (EarlyStopping, ModelCheckpoint).
    """

    def __init__(self):
        super().__init__()
        self._communicator = HorovodCommunicator()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)  # Same order on every worker.
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        [averaged] = self._communicator.allreduce([values], op="average")
        for key, value in zip(keys, averaged.numpy()):
            logs[key] = float(value)


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramp the learning rate from ``target_lr / size`` to ``target_lr`` over the first epochs.

    Large global batches want a learning rate scaled with the number of workers
    (Goyal et al., https://arxiv.org/abs/1706.02677); warming up to it avoids early
    divergence.

    Args:
        target_lr: learning rate after warm-up (typically base rate × workers).
        warmup_epochs: length of the ramp, in epochs.
        steps_per_epoch: batches per epoch (the ramp advances every batch).
    """

    def __init__(self, target_lr, warmup_epochs=5, steps_per_epoch=None):
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"`warmup_epochs` must be > 0. Received: warmup_epochs={warmup_epochs}")
        self.target_lr = float(target_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._size = HorovodCommunicator().size

    def learning_rate_at(self, epoch, batch):
        """Return the warm-up learning rate at (`epoch`, `batch`)."""
        steps = self.steps_per_epoch or self.params.get("steps") or 1
        progress = min(1.0, (epoch + batch / steps) / self.warmup_epochs)
        start = self.target_lr / self._size
        return start + (self.target_lr - start) * progress

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.warmup_epochs:
            self.model.optimizer.learning_rate.assign(self.learning_rate_at(self._epoch, batch))


def _stats_source(model):
    if isinstance(model.distribute_strategy, HorovodStrategy):
        return model.distribute_strategy.communication_stats
    if model.optimizer is not None and bound_reducer(model.optimizer) is not None:
        return model.optimizer.communication_stats
    raise ValueError(
        "CommunicationLogger needs a tfdp strategy (model built under its scope) or a "
        "tfdp.DistributedOptimizer; this model has neither."
    )


class CommunicationLogger(keras.callbacks.Callback):
    """Add gradient traffic per step to each epoch's logs, and to TensorBoard.

    Adds to the epoch logs (and so to ``History``): ``gradient_bytes_per_step`` (bytes of
    gradient payload this worker handed to collectives), ``dense_bytes_per_step`` (what
    float32 all-reduce would have sent) and ``compression_ratio`` (their ratio), averaged
    over the epoch's steps. With `log_dir`, rank 0 also writes them as TensorBoard
    scalars under ``communication/``.

    Example:
        >>> history = model.fit(x, y, callbacks=[tfdp.callbacks.CommunicationLogger("logs")])
        >>> history.history["compression_ratio"]
    """

    def __init__(self, log_dir=None):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        self._start = None

    def on_train_begin(self, logs=None):
        self._read = _stats_source(self.model)
        if self.log_dir is not None and self._is_chief():
            self._writer = tf.summary.create_file_writer(str(self.log_dir))

    def _is_chief(self):
        strategy = self.model.distribute_strategy
        return strategy.is_chief if isinstance(strategy, HorovodStrategy) else True

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._read()

    def on_epoch_end(self, epoch, logs=None):
        now = self._read()
        steps = now["steps"] - self._start["steps"]
        if steps <= 0 or logs is None:
            return
        sent = (now["gradient_bytes"] - self._start["gradient_bytes"]) / steps
        dense = (now["dense_bytes"] - self._start["dense_bytes"]) / steps
        values = {
            "gradient_bytes_per_step": sent,
            "dense_bytes_per_step": dense,
            "compression_ratio": dense / sent if sent else float("nan"),  # nothing sent: one worker
        }
        logs.update(values)
        if self._writer is not None:
            with self._writer.as_default():
                for name, value in values.items():
                    tf.summary.scalar(f"communication/{name}", value, step=epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
