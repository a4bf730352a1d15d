"""Split global batches across workers.

Rule: a global batch of ``n`` rows gives rank ``r`` of ``P`` the contiguous rows
``[n*r//P, n*(r+1)//P)``. Full batches of a batch size divisible by ``P`` split
evenly; a smaller last batch splits as evenly as possible (ranks differ by at most
one row, and no row is dropped or repeated). Concatenating the ranks' rows in rank
order gives back the global batch, which is how `predict` restores input order.
Dense, sparse (`tf.SparseTensor`) and ragged (`tf.RaggedTensor`) inputs split by rows.
With a `tfdp.strategies.balance.Balancer` the boundaries follow its weights instead. Its
weights are read when a batch is split: a change of weights between two steps applies to the
next step on every rank alike.

Where the split happens: Keras's `fit`, `evaluate` and `predict` (and the `*_on_batch`
methods) hand each step the whole global batch and the step takes its rows
(`HorovodExtended._call_for_each_replica`); `strategy.experimental_distribute_dataset`, for
custom loops, maps the split as the dataset's last transformation (evaluated by the step's
own ``get_next``, after any prefetch).
"""

import tensorflow as tf


def rank_rows(n, rank, size):
    """Return ``(start, stop)`` of rank's share of a batch of ``n`` rows.

    Example:
        >>> rank_rows(10, 1, 3)
        (3, 6)
    """
    return (n * rank) // size, (n * (rank + 1)) // size


def num_rows(t):
    """Rows of a dense, sparse or ragged tensor, as an int64 scalar tensor."""
    if isinstance(t, tf.SparseTensor):
        return t.dense_shape[0]
    if isinstance(t, tf.RaggedTensor):
        return t.nrows(out_type=tf.int64)
    return tf.shape(t, out_type=tf.int64)[0]


def _slice_rows(t, start, stop):
    if isinstance(t, tf.SparseTensor):
        rank = tf.size(t.dense_shape)
        begin = tf.concat([[start], tf.zeros([rank - 1], tf.int64)], 0)
        size = tf.concat([[stop - start], t.dense_shape[1:]], 0)
        rows = tf.sparse.slice(t, begin, size)
        rows.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))  # Keras builds layers from it
        return rows
    return t[start:stop]


def share_of_rank(n, rank, size, balancer=None):
    """``(start, stop)`` of rank's rows of a global batch of `n` rows: equal shares, or the
    `balancer`'s (int64 tensors then)."""
    if balancer is None:
        return rank_rows(n, rank, size)
    bounds = balancer.bounds(n)
    return bounds[rank], bounds[rank + 1]


def take_rows(structure, rank, size, balancer=None):
    """This rank's rows of one global batch (any nest of dense, sparse or ragged tensors)."""
    flat = [t for t in tf.nest.flatten(structure, expand_composites=False) if t is not None]
    start, stop = share_of_rank(num_rows(flat[0]), rank, size, balancer)
    return tf.nest.map_structure(lambda t: None if t is None else _slice_rows(t, start, stop), structure)


def shard_global_batches(dataset, rank, size, balancer=None):
    """Return a dataset yielding this rank's rows of every global batch of `dataset`.

    Example:
        >>> ds = tf.data.Dataset.range(8).batch(4)
        >>> [b.numpy().tolist() for b in shard_global_batches(ds, rank=1, size=2)]
        [[2, 3], [6, 7]]
    """
    if size == 1:
        return dataset
    unpacked = isinstance(dataset.element_spec, tuple)  # tf.data passes a tuple's parts as arguments

    # take_rows has no tensor-dependent Python control flow: nothing for autograph to convert.
    @tf.autograph.experimental.do_not_convert
    def rows(*batch):
        return take_rows(batch if unpacked else batch[0], rank, size, balancer)

    return dataset.map(rows)
