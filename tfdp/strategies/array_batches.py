"""Batches of in-memory arrays, cut by reshape: Keras's `fit` on arrays without its per-call pipeline.

Keras's `ArrayDataAdapter.get_tf_dataset` (keras/src/trainers/data_adapters/
array_data_adapter.py) builds, on every `fit`, `evaluate` and `predict` call, a pipeline of
three traced functions (the epoch's index permutation, its batches of indices, and a parallel
gather) with an autotuned prefetch. On the `make bench` MLP under tfdp that pipeline took
tfdp's `fit` from the hand-written Horovod loop's speed (0.995x, the same `fit` fed a prebuilt
`tf.data` dataset) to 0.894x, in the same two processes (docs/results.md, "Arrays without
Keras's per-fit pipeline"). Unshuffled batches are consecutive rows, so tfdp cuts them by
reshaping the arrays: the same rows in the same order, and no function to trace.
"""

import numpy as np
import tensorflow as tf


def _batched(array, full_batches, batch_size):
    rows = full_batches * batch_size
    if isinstance(array, np.ndarray):
        return array[:rows].reshape((full_batches, batch_size) + array.shape[1:])
    return tf.reshape(array[:rows], tf.concat([[full_batches, batch_size], tf.shape(array)[1:]], 0))


def _dense(leaf):
    if isinstance(leaf, np.ndarray):
        return leaf.dtype != object
    return tf.is_tensor(leaf) and not isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor))


def whole_batches(inputs, batch_size):
    """Return a dataset of the consecutive `batch_size`-row batches of `inputs`, or None.

    The last batch holds the remaining rows. The element spec is Keras's: the batch dimension is
    known when every batch is full, unknown when the last one is not. None when a leaf of
    `inputs` is not a dense NumPy array or tensor (sparse, ragged, object arrays): Keras's
    pipeline handles those.

    Args:
        inputs: a nest (tuples, dicts) of arrays or tensors with the same number of rows.
        batch_size: rows per batch, a positive int.

    Example:
        >>> ds = whole_batches((np.arange(5.0), np.arange(5)), 2)
        >>> [x.numpy().tolist() for x, _ in ds]
        [[0.0, 1.0], [2.0, 3.0], [4.0]]
        >>> ds.element_spec[0].shape.as_list(), whole_batches((np.arange(4.0),), 2).element_spec[0].shape.as_list()
        ([None], [2])
    """
    leaves = tf.nest.flatten(inputs)
    if not leaves or not all(_dense(leaf) for leaf in leaves):
        return None
    num_rows = int(leaves[0].shape[0])
    full_batches = num_rows // batch_size
    batches = tf.data.Dataset.from_tensor_slices(
        tf.nest.map_structure(lambda a: _batched(a, full_batches, batch_size), inputs))
    if num_rows % batch_size:
        rest = tf.nest.map_structure(lambda a: a[full_batches * batch_size:], inputs)
        batches = batches.concatenate(tf.data.Dataset.from_tensors(rest))
    options = tf.data.Options()
    # As Keras's pipeline: no default rewrites, which would serialize the arrays with the graph.
    options.experimental_optimization.apply_default_optimizations = False
    return batches.with_options(options)
