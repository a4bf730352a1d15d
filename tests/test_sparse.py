"""The sparse path for embedding gradients (`tfdp.reducers.sparse`), on fake ranks.

Rows are summed per index on each worker, then travel as rows (all-gather) or the dense
tensor (all-reduce), whichever the cost model says is cheaper; the sum is the dense sum
either way, and the byte counters count what travelled. The 2-worker Keras run with a
100,000-row embedding is in ``tests/test_sparse_training.py``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.comm.fake import run_ranks
from tfdp.reducers import AllReduceGradients
from tfdp.reducers.sparse import deduplicate, sparse_is_cheaper

ROWS, WIDTH = 1000, 8


def test_duplicates_are_summed_once_per_index_in_order_of_first_appearance():
    slices = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0], [8.0]]), tf.constant([7, 3, 7, 7]),
                              tf.constant([10, 1]))
    unique = deduplicate(slices)
    assert unique.indices.numpy().tolist() == [7, 3]
    assert unique.values.numpy().ravel().tolist() == [13.0, 2.0]
    np.testing.assert_array_equal(tf.convert_to_tensor(unique).numpy(), tf.convert_to_tensor(slices).numpy())


def test_the_cost_rule_compares_rows_with_twice_the_dense_tensor():
    # 100 rows of 8 (+ 1 index) = 900 elements against 2 x 1000 x 8: rows.
    assert bool(sparse_is_cheaper(100, WIDTH, ROWS * WIDTH))
    # 1000 rows (every row, from two workers: 2 x 1000): dense.
    assert not bool(sparse_is_cheaper(2 * ROWS, WIDTH, ROWS * WIDTH))
    assert not bool(sparse_is_cheaper(1778, WIDTH, ROWS * WIDTH)) and bool(sparse_is_cheaper(1777, WIDTH, ROWS * WIDTH))


def lookups(rank, touched):
    """Rank `rank`'s gradient of a batch that looks up `touched` rows (each twice)."""
    rng = np.random.default_rng(rank)
    index = rng.choice(ROWS, size=touched, replace=False)
    index = np.concatenate([index, index])  # every row looked up twice: duplicates
    values = rng.normal(size=(len(index), WIDTH)).astype("float32")
    return tf.IndexedSlices(tf.constant(values), tf.constant(index, tf.int32), tf.constant([ROWS, WIDTH]))


@pytest.mark.parametrize("touched, path", [(20, "rows"), (ROWS, "dense")])
def test_the_sum_is_the_dense_sum_on_either_path_and_the_bytes_are_what_travelled(touched, path):
    def body(comm):
        [table] = [tf.Variable(tf.zeros([ROWS, WIDTH]), name="embedding")]
        [summed] = AllReduceGradients(comm, op="sum").reduce([lookups(comm.rank, touched)], [table])
        return summed, comm.stats.as_dict()

    expected = sum(tf.convert_to_tensor(lookups(rank, touched)).numpy() for rank in range(2))
    for summed, stats in run_ranks(2, body):
        assert isinstance(summed, tf.IndexedSlices)
        np.testing.assert_allclose(tf.convert_to_tensor(summed).numpy(), expected, rtol=1e-6, atol=1e-6)
        assert stats["dense_bytes"] == ROWS * WIDTH * 4
        if path == "rows":  # each worker's 20 rows once (duplicates summed), 8 floats + an index each
            assert stats["gradient_bytes"] == 20 * (WIDTH + 1) * 4
            assert len(np.unique(summed.indices.numpy())) == len(summed.indices.numpy()) <= 40
        else:  # every row touched: the dense tensor was all-reduced (the negative control)
            assert stats["gradient_bytes"] == ROWS * WIDTH * 4


@pytest.mark.parametrize("optimizer", [keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, clipnorm=1.0)],
                         ids=["adam", "sgd-clipnorm"])
def test_an_update_that_sees_duplicate_rows_gets_every_workers_rows_unsummed_in_rank_order(optimizer):
    # Keras's Adam squares each duplicate row, clip_by_norm measures them: one process's numbers
    # need the rows as they were looked up, so nothing is summed and nothing is densified.
    def body(comm):
        table = tf.Variable(tf.zeros([ROWS, WIDTH]), name="embedding")
        [summed] = AllReduceGradients(comm, op="sum").reduce([lookups(comm.rank, 20)], [table], optimizer)
        return summed, comm.stats.as_dict()

    every = [lookups(rank, 20) for rank in range(2)]
    for summed, stats in run_ranks(2, body):
        np.testing.assert_array_equal(summed.indices.numpy(), np.concatenate([s.indices.numpy() for s in every]))
        np.testing.assert_allclose(summed.values.numpy(), np.concatenate([s.values.numpy() for s in every]))
        assert stats["gradient_bytes"] == 40 * (WIDTH + 1) * 4  # each worker's 40 lookups, duplicates included


def test_sgd_without_clipping_is_the_only_update_that_lets_duplicates_be_summed():
    from tfdp.reducers.optimizer_view import view
    assert view(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)).linear_in_slices
    assert view(None).linear_in_slices
    for optimizer in (keras.optimizers.Adam(), keras.optimizers.RMSprop(), keras.optimizers.SGD(0.1, clipvalue=1.0),
                      keras.optimizers.SGD(0.1, global_clipnorm=1.0)):
        assert not view(optimizer).linear_in_slices, optimizer
