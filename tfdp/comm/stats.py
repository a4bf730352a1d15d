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


def total_bytes(tensors, as_float32=False):
    """The bytes of `tensors` together (as float32 with `as_float32`): a Python int when every
    shape is known while tracing, else an int64 tensor.

    Example:
        >>> total_bytes([tf.zeros([3], tf.float16), tf.zeros([2, 2])])
        22
    """
    static = [_static_bytes(t, as_float32) for t in tensors]
    if None not in static:
        return sum(static)
    measure = float32_bytes if as_float32 else nbytes
    return tf.add_n([measure(t) for t in tensors])


def _static_bytes(tensor, as_float32):
    if isinstance(tensor, tf.IndexedSlices):
        shape = tf.get_static_value(tensor.dense_shape)
        count = None if shape is None else int(shape.prod())
    else:
        count = tensor.shape.num_elements()
    if count is None:
        return None
    return count * (4 if as_float32 else tensor.dtype.size)


class CommunicationStats:
    """Counters of what this worker handed to collectives.

    One int64 `tf.Variable` holds them all, so that steps running inside `tf.function` update
    them, and each update is one `AssignAdd` of a constant vector when the sizes are known at
    trace time (a step's bookkeeping costs a handful of graph ops, not dozens).
    `payload_bytes` counts every byte handed to a collective (gradients, metrics,
    initial broadcasts); `gradient_bytes` the part of it that carried gradients
    (payloads, indices, scales and norms); `dense_bytes` what the same gradients
    would have taken as float32 all-reduce.

    Example:
        >>> stats = CommunicationStats()
        >>> stats.add("steps", 1)
        >>> stats.add_many(collectives=1, payload_bytes=12)
        >>> stats.as_dict()["payload_bytes"]
        12
    """

    FIELDS = ("steps", "collectives", "payload_bytes", "gradient_bytes", "dense_bytes", "rounds")

    def __init__(self):
        self._counts = local_variable(tf.zeros([len(self.FIELDS)], tf.int64), "tfdp_communication_counts")

    def add(self, name, amount):
        """Add `amount` (a Python int or an integer tensor) to counter `name`."""
        self.add_many(**{name: amount})

    def add_many(self, **amounts):
        """Add to several counters in one update (Python ints or integer tensors, by field name)."""
        unknown = sorted(set(amounts) - set(self.FIELDS))
        if unknown:
            raise KeyError(f"Unknown counters {unknown}; the counters are {list(self.FIELDS)}.")
        values = [amounts.get(name, 0) for name in self.FIELDS]
        if all(isinstance(v, int) for v in values):
            delta = tf.constant(values, tf.int64)
        else:
            delta = tf.stack([tf.cast(v, tf.int64) for v in values])
        self._counts.assign_add(delta, read_value=False)

    def count_step(self, grads, rounds=0, new_step=True):
        """Count one gradient step (unless `new_step` is False: more gradients of a step already
        counted), the float32 size of its gradients (None ignored) and `rounds`."""
        present = [g for g in grads if g is not None]
        self.add_many(steps=int(new_step), rounds=rounds, dense_bytes=total_bytes(present, as_float32=True))

    def as_dict(self):
        """Return the counters as Python ints."""
        return dict(zip(self.FIELDS, (int(v) for v in self._counts.numpy())))
