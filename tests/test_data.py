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


def tfdp_installed():
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    return hasattr(ArrayDataAdapter.get_tf_dataset, "_tfdp_original")


def keras_own_dataset(adapter):
    """`get_tf_dataset` as Keras wrote it, whether or not tfdp's hook is installed."""
    method = type(adapter).get_tf_dataset
    return (method._tfdp_original if tfdp_installed() else method)(adapter)


def keras_batches(x, y=None, sample_weight=None, batch_size=32, shuffle=False):
    """The batches Keras's own pipeline gives."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    adapter = ArrayDataAdapter(x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=shuffle)
    return adapter, list(keras_own_dataset(adapter).as_numpy_iterator())


def assert_same_batches(expected, got):
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        tf.nest.assert_same_structure(e, g)
        for a, b in zip(tf.nest.flatten(e), tf.nest.flatten(g)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


def test_arrays_cut_by_reshape_give_keras_s_own_batches():
    from keras import tree
    from keras.src.trainers.data_adapters import array_slicing

    from tfdp.strategies.array_batches import whole_batches

    rng = np.random.default_rng(0)
    cases = [
        dict(x=rng.normal(size=(101, 3)).astype("float32"), y=rng.integers(0, 4, 101), batch_size=32),
        # float64 cast to floatx, dict and list inputs, sample weights, exact batches
        dict(x={"a": rng.normal(size=(64, 2)), "b": [np.arange(64), np.ones((64, 2, 2), "float16")]},
             y=np.arange(64.0), sample_weight=np.linspace(0, 1, 64), batch_size=16),
        dict(x=tf.constant(rng.normal(size=(5, 4)).astype("float32")), y=np.array(list("abcde"), dtype=object), batch_size=8),
    ]
    for case in cases:
        adapter, expected = keras_batches(**case)
        inputs = tree.lists_to_tuples(array_slicing.convert_to_sliceable(adapter._inputs, target_backend="tensorflow"))
        batches = whole_batches(inputs, adapter._batch_size)
        assert_same_batches(expected, list(batches.as_numpy_iterator()))
        assert batches.element_spec == keras_own_dataset(adapter).element_spec  # steps trace as under Keras
    # Negative control: shuffled batches are not Keras's unshuffled ones.
    _, shuffled = keras_batches(**cases[0], shuffle=True)
    with np.testing.assert_raises(AssertionError):
        assert_same_batches(keras_batches(**cases[0])[1], shuffled)
    # Sparse inputs are left to Keras's pipeline.
    assert whole_batches((tf.sparse.from_dense(np.eye(4, dtype="float32")),), 2) is None


def dataset_kinds(dataset):
    """Class names of `dataset` and every dataset it reads from."""
    kinds, stack = [], [dataset]
    while stack:
        ds = stack.pop()
        kinds.append(type(ds).__name__)
        stack.extend(ds._inputs())
    return kinds


def test_fit_under_tfdp_cuts_unshuffled_arrays_and_leaves_shuffled_ones_to_keras():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    import tfdp

    x, y = np.arange(40.0).reshape(20, 2).astype("float32"), np.arange(20.0)
    strategy = tfdp.MirroredStrategy()

    def kinds(shuffle, distribute_strategy):
        iterator = TFEpochIterator(x=x, y=y, batch_size=8, shuffle=shuffle, distribute_strategy=distribute_strategy)
        return dataset_kinds(iterator._distributed_dataset)

    assert "_TensorSliceDataset" in kinds(False, strategy)
    assert not any("Map" in kind for kind in kinds(False, strategy))
    # Controls: shuffled arrays, and arrays without a tfdp strategy, keep Keras's mapped pipeline.
    assert "_ParallelMapDataset" in kinds(True, strategy)
    assert "_ParallelMapDataset" in kinds(False, tf.distribute.get_strategy())


def test_dataset_order_tells_a_seeded_shuffle_from_one_each_process_draws():
    from tfdp._compat.tensorflow import ORDER_DRAWN_PER_PROCESS, dataset_order
    from tfdp._compat.tensorflow import global_seed

    previous = global_seed()
    tf.random.set_seed(None)
    try:
        rows = tf.data.Dataset.range(64)
        # Nothing random: 0; a seeded shuffle anywhere upstream: its seeds, equal for equal seeds.
        assert dataset_order(rows.map(lambda x: x + 1).batch(8)) == 0
        seeded = dataset_order(rows.shuffle(64, seed=3).batch(8).prefetch(2))
        assert seeded not in (0, ORDER_DRAWN_PER_PROCESS)
        assert dataset_order(rows.shuffle(64, seed=3).batch(8)) == seeded
        assert dataset_order(rows.shuffle(64, seed=4).batch(8)) != seeded
        # Orders no seed fixes: each process draws its own.
        for drawn in (rows.shuffle(64), tf.data.Dataset.zip((rows, rows.shuffle(8))),
                      tf.data.Dataset.sample_from_datasets([rows, rows]),
                      rows.map(lambda x: x * 2, num_parallel_calls=2, deterministic=False)):
            assert dataset_order(drawn.batch(8)) == ORDER_DRAWN_PER_PROCESS
        # With a global seed the op seeds follow from it: the same sequence in every process.
        tf.random.set_seed(5)
        first = [dataset_order(rows.shuffle(64)) for _ in range(2)]
        tf.random.set_seed(5)
        assert [dataset_order(rows.shuffle(64)) for _ in range(2)] == first
        assert ORDER_DRAWN_PER_PROCESS not in first and first[0] != first[1]
        assert dataset_order([1, 2]) == 0  # not a dataset
    finally:
        tf.random.set_seed(previous)


def test_shards_and_cache_files_are_read_from_the_pipeline(tmp_path):
    from tfdp._compat.tensorflow import dataset_cache_files, dataset_shards

    rows = tf.data.Dataset.range(16)
    assert dataset_shards(rows.batch(4)) == [] and dataset_shards(rows.shard(1, 0)) == []
    assert dataset_shards(rows.shard(2, 1).map(lambda x: x).batch(4)) == [(2, 1)]
    # A file cache is one this pipeline writes until it is complete; an in-memory one writes nothing.
    cached = rows.cache(str(tmp_path / "train")).batch(4)
    assert dataset_cache_files(cached) == [str(tmp_path / "train")]
    assert dataset_cache_files(rows.cache().batch(4)) == []
    list(cached)
    assert dataset_cache_files(rows.cache(str(tmp_path / "train")).batch(4)) == []
