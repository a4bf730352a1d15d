"""`GlobalEpochLogs`: epoch logs averaged across ranks when step logs are per-rank.

With ``global_step_logs=False`` (the asynchronous strategies' default) a step's outputs stay
this rank's. Keras's own metrics are still global at the end of an epoch (their variables
are summed when read), but a custom `train_step` that returns other values (a raw loss, a
constant) hands Keras per-rank epoch logs, and `History`, `EarlyStopping` or
`ReduceLROnPlateau` would see different numbers on each rank. This callback runs first and
averages the epoch's numeric logs in place (one small all-reduce per epoch); values that are
already global come back unchanged.
"""

import numbers

import keras
import numpy as np
import tensorflow as tf


class GlobalEpochLogs(keras.callbacks.Callback):
    """Average every numeric epoch log across the workers of `communicator`."""

    def __init__(self, communicator):
        super().__init__()
        self.communicator = communicator

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = self.communicator.allreduce([values], op="average")[0].numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_number(value):
    if isinstance(value, bool):
        return False
    if isinstance(value, (numbers.Number, np.number)):
        return True
    return tf.is_tensor(value) and value.shape.rank == 0 and (value.dtype.is_floating or value.dtype.is_integer)
