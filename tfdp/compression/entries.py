"""Sparse entries (flat indices and values) into dense tensors and variables.

Example:
    >>> dense_of_entries(tf.constant([2, 0, 2]), tf.constant([1.0, 5.0, 2.0]), [2, 2]).numpy().tolist()
    [[5.0, 0.0], [3.0, 0.0]]
"""

import tensorflow as tf

from tfdp._compat.tensorflow import assign_handle, read_handle, resource_variable_of


def dense_of_entries(indices, values, shape, dtype=tf.float32):
    """A dense tensor of `shape` holding the sum of `values` at flat `indices` (repeats add up).

    Example:
        >>> dense_of_entries(tf.constant([2, 0, 2]), tf.constant([1.0, 5.0, 2.0]), [2, 2]).numpy().tolist()
        [[5.0, 0.0], [3.0, 0.0]]
    """
    shape = tf.TensorShape(shape)
    # unsorted_segment_sum adds in index order, as scatter_nd does, at a quarter of its cost
    # per entry on CPU (120 k entries into 6 M: 14 ms against 38 ms, zero fill included).
    dense = tf.math.unsorted_segment_sum(tf.cast(values, dtype), indices, shape.num_elements())
    return tf.reshape(dense, shape)


def add_entries(variable, indices, values):
    """Add `values` at the flat `indices` of `variable`, in place (repeats add up, one after
    the other, in the order given).

    XLA compiles the scatter into a loop over the entries that writes into the variable's own
    buffer. Top-k's two updates of a 3.9 M variable (79 k and 118 k entries) took 2.2-2.6 ms here,
    against 7.3-7.7 ms building a dense tensor of each and adding it; TensorFlow's own scatter
    kernels into a variable cost about 85 ns per entry (stop 37, docs/results.md).

    Example:
        >>> v = tf.Variable(tf.zeros([2, 2]))
        >>> add_entries(v, tf.constant([3, 0, 3]), tf.constant([1.0, 5.0, 2.0]))
        >>> v.numpy().tolist()
        [[5.0, 0.0], [0.0, 3.0]]
    """
    values = tf.cast(values, variable.dtype)
    target = resource_variable_of(variable)
    if target is not None:
        _scatter_add_into(target.handle, indices, values, tuple(target.shape))
    else:  # a variable XLA cannot take: the same sums, into a new tensor assigned after
        variable.assign(_scatter_added(tf.convert_to_tensor(variable), indices, values))


# The variable's handle, not the variable, is the argument: a tf.function traced with one
# variable reuses that trace for the next of the same shape, which then still updates the first.
@tf.function(jit_compile=True)
def _scatter_add_into(handle, indices, values, shape):
    assign_handle(handle, _scatter_added(tf.ensure_shape(read_handle(handle, values.dtype), shape), indices, values))


@tf.function(jit_compile=True)
def _scatter_added(tensor, indices, values):
    flat = tf.tensor_scatter_nd_add(tf.reshape(tensor, [-1]), indices[:, None], values)
    return tf.reshape(flat, tf.shape(tensor))
