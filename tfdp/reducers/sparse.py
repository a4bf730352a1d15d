"""The sparse path: embedding gradients (`tf.IndexedSlices`) travel as the rows a step touched.

A batch that looks up a few thousand rows of a 1 M-row embedding has a gradient that is
zero almost everywhere. Densified, it would all-reduce the whole table every step. Here,
per `IndexedSlices` gradient:

1. each worker sums its duplicate rows (`deduplicate`: a row looked up 50 times is sent once);
2. the workers learn how many rows all of them hold (one small all-reduce of the counts,
   for every sliced gradient of the step together);
3. the cost model chooses (`sparse_is_cheaper`): a ring all-gather of rows moves
   ``(P - 1) / P x`` all workers' rows, a ring all-reduce ``2 (P - 1) / P x`` the dense
   tensor (see `tfdp.tools.advisor`), so rows travel when all workers' rows (values and
   index) are fewer bytes than twice the dense tensor; else the dense tensor is all-reduced.
   Every worker sees the same counts and takes the same branch;
4. rows travel with their index in one float32 collective (the int32 index bit-cast into
   one more column), and the gathered rows are summed per index again, so the optimizer
   receives each touched row once.

Byte counters count what travels: the rows and indices, or the dense tensor.

Summing duplicate rows is exact only for an optimizer whose update depends on the gradient
through its dense sum (`OptimizerView.linear_in_slices`: SGD, with or without momentum, and
no clipping). Keras 3 applies IndexedSlices row by row, so one process under Adam adds the
square of every duplicate row to the second moment, and `clipnorm` measures the duplicates.
To give the numbers of one process there (``merge_duplicates=False``), every worker's rows
travel as they are, in rank order (the order of the global batch), and nothing is summed.

Example:
    >>> slices = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([4, 1, 4]), tf.constant([10, 2]))
    >>> deduplicate(slices).indices.numpy().tolist()
    [4, 1]
"""

import tensorflow as tf


def deduplicate(slices):
    """`slices` with each index once, its rows summed (in order of first appearance)."""
    indices = tf.cast(slices.indices, tf.int64)
    unique, position = tf.unique(indices)
    values = tf.math.unsorted_segment_sum(slices.values, position, tf.size(unique))
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def sparse_is_cheaper(total_rows, row_elements, dense_elements):
    """True when all workers' `total_rows` rows (plus an index each) cost less on a ring than an
    all-reduce of the dense tensor: ``total_rows x (row_elements + 1) < 2 x dense_elements``."""
    rows = tf.cast(total_rows, tf.float64) * (float(row_elements) + 1.0)
    return rows < 2.0 * tf.cast(dense_elements, tf.float64)


def exchange_slices(communicator, slices, op, merge_duplicates=True):
    """Sum `slices` (a list of IndexedSlices) across workers; return IndexedSlices (``op`` is
    ``"sum"`` or ``"average"``). Each takes the sparse or the dense path, as described above;
    with ``merge_duplicates=False`` every worker's rows are gathered unsummed."""
    if not merge_duplicates:
        return [_gathered(communicator, s, op, merge_duplicates=False) for s in slices] \
            if communicator.size > 1 else list(slices)
    slices = [deduplicate(s) for s in slices]
    if communicator.size == 1:
        return slices
    counts = tf.cast(tf.stack([tf.size(s.indices) for s in slices]), tf.float32)  # exact below 2**24
    totals = tf.unstack(communicator.allreduce([counts], op="sum")[0])
    communicator.stats.add("rounds", 1)
    return [tf.cond(sparse_is_cheaper(total, _row_elements(s), tf.reduce_prod(tf.cast(s.dense_shape, tf.int64))),
                    lambda s=s: _gathered(communicator, s, op),
                    lambda s=s: _all_reduced(communicator, s, op))
            for s, total in zip(slices, totals)]


def _row_elements(slices):
    shape = slices.values.shape[1:]
    if not shape.is_fully_defined():
        raise ValueError(f"tfdp: an IndexedSlices gradient with rows of unknown shape {shape}; "
                         "the sparse path needs the row shape when the step is traced.")
    return shape.num_elements()


def _gathered(communicator, s, op, merge_duplicates=True):
    values = s.values
    table_rows = tf.get_static_value(s.dense_shape)
    if values.dtype == tf.float32 and table_rows is not None and table_rows[0] < 2 ** 31:
        # One collective: the index rides, bit-cast, as one more float32 column.
        flat = tf.reshape(values, [-1, _row_elements(s)])
        index = tf.bitcast(tf.cast(s.indices, tf.int32), tf.float32)[:, None]
        [packed] = communicator.allgather_many([tf.concat([flat, index], 1)], gradients=True)
        values = tf.reshape(packed[:, :-1], tf.concat([[-1], tf.shape(s.values)[1:]], 0))
        indices = tf.cast(tf.bitcast(packed[:, -1], tf.int32), tf.int64)
    else:
        values, indices = communicator.allgather_many([values, s.indices], gradients=True)
    if op == "average":
        values = values / communicator.size
    gathered = tf.IndexedSlices(values, indices, s.dense_shape)
    return _as_float_rows(deduplicate(gathered) if merge_duplicates else gathered)


def _all_reduced(communicator, s, op):
    [dense] = communicator.allreduce([tf.convert_to_tensor(s)], op=op, gradients=True)
    every_row = tf.range(tf.shape(dense, out_type=tf.int64)[0])
    return _as_float_rows(tf.IndexedSlices(dense, every_row, s.dense_shape))


def _as_float_rows(slices):
    # Both branches of the cond return the same structure: [rows, ...] values, int64 indices.
    return tf.IndexedSlices(slices.values, tf.cast(slices.indices, tf.int64), tf.cast(slices.dense_shape, tf.int64))


__all__ = ["deduplicate", "exchange_slices", "sparse_is_cheaper"]
