"""Global batches split into per-rank rows: dense, sparse, ragged, every size."""

import numpy as np
import tensorflow as tf

from tfdp.strategies.data import rank_rows, shard_global_batches, take_rows


def test_rank_rows_partition_every_batch_in_order():
    for size in (1, 2, 3, 4, 7):
        for n in range(0, 40):
            rows = []
            for rank in range(size):
                start, stop = rank_rows(n, rank, size)
                rows.extend(range(start, stop))
                assert stop - start in (n // size, n // size + 1), (n, size, rank)
            assert rows == list(range(n)), (n, size)


def test_shard_global_batches_keeps_structure():
    ds = tf.data.Dataset.from_tensor_slices((np.arange(10), {"a": np.arange(10) * 2})).batch(4)
    shards = [list(shard_global_batches(ds, rank, 2).as_numpy_iterator()) for rank in (0, 1)]
    assert [x.tolist() for x, _ in shards[1]] == [[2, 3], [6, 7], [9]]
    assert [d["a"].tolist() for _, d in shards[0]] == [[0, 2], [8, 10], [16]]


def test_sparse_and_ragged_batches_split_by_rows():
    dense = np.arange(15, dtype="float32").reshape(5, 3) * (np.arange(15).reshape(5, 3) % 2)
    sparse = tf.sparse.from_dense(dense)
    ragged = tf.ragged.constant([[1], [2, 3], [], [4, 5, 6], [7]])
    parts = [take_rows((sparse, ragged), rank, 2) for rank in (0, 1)]
    np.testing.assert_array_equal(
        np.concatenate([tf.sparse.to_dense(s).numpy() for s, _ in parts]), dense)
    assert [r.to_list() for _, r in parts] == [[[1], [2, 3]], [[], [4, 5, 6], [7]]]
    assert [int(s.dense_shape[0]) for s, _ in parts] == [2, 3]


def test_a_sparse_batch_split_inside_a_traced_step_keeps_its_feature_dimensions():
    # Keras builds a model's layers from the first step's input shapes (the Keras suite's
    # `test_predict_sparse_scipy_graph` failed with a kernel of shape (None, 3) without this).
    batch = tf.sparse.from_dense(tf.ones([5, 3]))
    shapes = []

    @tf.function
    def step(sparse):
        rows = take_rows((sparse,), 1, 2)[0]
        shapes.append(rows.shape.as_list())
        return tf.sparse.to_dense(rows)

    assert step(batch).shape == (3, 3)  # rows [2, 5) of 5
    assert shapes == [[None, 3]]
