"""`CommunicationStats`: counters of what one worker handed to collectives."""

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable


def nbytes(tensor):
    """Return the size of `tensor` in bytes as an int64 tensor (works for dynamic shapes)."""
    return tf.size(tensor, out_type=tf.int64) * tensor.dtype.size


def float32_bytes(tensor):
    """Return what `tensor` would take as float32, in bytes (IndexedSlices: its dense size)."""
    if isinstance(tensor, tf.IndexedSlices):
        return tf.reduce_prod(tf.cast(tensor.dense_shape, tf.int64)) * 4
    return tf.size(tensor, out_type=tf.int64) * 4


class CommunicationStats:
    """Counters of what this worker handed to collectives.

    They are `tf.Variable`s so that steps running inside `tf.function` update them.
    `payload_bytes` counts every byte handed to a collective (gradients, metrics,
    initial broadcasts); `gradient_bytes` the part of it that carried gradients
    (payloads, indices, scales and norms); `dense_bytes` what the same gradients
    would have taken as float32 all-reduce.

    Example:
        >>> stats = CommunicationStats()
        >>> stats.add("steps", 1)
        >>> stats.as_dict()["steps"]
        1
    """

    FIELDS = ("steps", "collectives", "payload_bytes", "gradient_bytes", "dense_bytes", "rounds")

    def __init__(self):
        self._vars = {name: local_variable(tf.constant(0, tf.int64), f"tfdp_{name}") for name in self.FIELDS}

    def add(self, name, amount):
        """Add `amount` (a Python int or an integer tensor) to counter `name`."""
        return self._vars[name].assign_add(tf.cast(amount, tf.int64))

    def count_step(self, grads):
        """Count one gradient step and the float32 size of its gradients (None ignored)."""
        self.add("steps", 1)
        present = [g for g in grads if g is not None]
        if present:
            self.add("dense_bytes", tf.add_n([float32_bytes(g) for g in present]))

    def as_dict(self):
        """Return the counters as Python ints."""
        return {name: int(var.numpy()) for name, var in self._vars.items()}
