"""Every reducer through the one protocol, on fake ranks in one process (no horovodrun)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.comm.fake import run_ranks
from tfdp.compression import PowerSGD, TopK
from tfdp.reducers import AllReduceGradients, CompressedGradients, LocalSGD, ReducerState, StaleGradients


def variables(shapes, prefix="dense"):
    return [tf.Variable(tf.zeros(s), name=f"{prefix}{i}") for i, s in enumerate(shapes)]


def test_allreduce_keeps_none_and_sums_dense_and_gathers_slices():
    def body(comm):
        r = comm.rank
        vs = variables([(3,), (4, 2), (5,)])
        grads = [tf.fill([3], r + 1.0), None,
                 tf.IndexedSlices(tf.constant([[r + 1.0]]), tf.constant([r * 2]), tf.constant([5, 1]))]
        out = AllReduceGradients(comm, op="average").reduce(grads, vs)
        return out, comm.stats.as_dict()

    for (dense, none, slices), stats in run_ranks(2, body):
        np.testing.assert_allclose(dense.numpy(), [1.5, 1.5, 1.5])
        assert none is None
        assert isinstance(slices, tf.IndexedSlices)  # never densified
        np.testing.assert_allclose(slices.values.numpy().ravel(), [0.5, 1.0])
        assert slices.indices.numpy().tolist() == [0, 2]
        assert stats["steps"] == 1 and stats["rounds"] == 2  # + the exchange of row counts
        assert stats["dense_bytes"] == 4 * (3 + 5)  # the slices' dense size, not their rows
        assert stats["gradient_bytes"] == 4 * 3 + (4 + 4)  # dense floats + one row and its index (float32 column)


def test_compressed_reducer_sums_the_same_payloads_on_every_rank_and_keeps_its_residual():
    rng = np.random.default_rng(0)
    local = [rng.normal(size=(2, 64, 8)).astype("float32")]  # per rank, one 64x8 gradient

    def body(comm):
        vs = variables([(64, 8)])
        reducer = CompressedGradients(comm, TopK(0.05), error_feedback=True, min_compress_bytes=0)
        grad = tf.constant(local[0][comm.rank])
        [summed] = reducer.reduce([grad], vs)
        residual = reducer.memory.residual(vs[0].name if not hasattr(vs[0], "path") else vs[0].path)
        return summed.numpy(), residual.numpy(), comm.stats.as_dict()

    (sum0, res0, stats), (sum1, res1, _) = run_ranks(2, body)
    np.testing.assert_array_equal(sum0, sum1)
    k = int(np.ceil(0.05 * 512))
    for rank, residual in enumerate((res0, res1)):
        sent = local[0][rank] - residual
        assert np.count_nonzero(sent) == k  # exactly the top k went out, the rest is remembered
        np.testing.assert_allclose(sum0.sum(), (local[0][0] - res0 + local[0][1] - res1).sum(), rtol=1e-5)
    assert stats["gradient_bytes"] == 8 * k


@pytest.mark.parametrize("codec, rounds", [
    ("fp16", 1), ("bf16", 1), ("qsgd", 1), ("efsign", 1), (TopK(0.05), 1), (PowerSGD(2), 2),
    (PowerSGD(2, alternate=True), 1),
])
def test_small_gradients_ride_in_the_codecs_collective_and_are_summed_exactly(codec, rounds):
    from tfdp.compression import resolve

    rng = np.random.default_rng(1)
    large, small = rng.normal(size=(2, 64, 32)).astype("float32"), rng.normal(size=(2, 7)).astype("float32")

    def body(comm):
        vs = variables([(64, 32), (7,)])
        reducer = CompressedGradients(comm, resolve(codec), error_feedback=False, min_compress_bytes=1024)
        summed = reducer.reduce([tf.constant(large[comm.rank]), tf.constant(small[comm.rank])], vs)
        return [s.numpy() for s in summed], comm.stats.as_dict()

    (sums0, stats), (sums1, _) = run_ranks(2, body)
    assert stats["collectives"] == rounds  # not one more for the 7 small entries
    np.testing.assert_array_equal(sums0[1], small[0] + small[1])  # exact, uncompressed
    for a, b in zip(sums0, sums1):
        np.testing.assert_array_equal(a, b)


def test_a_gather_among_many_workers_leaves_many_small_gradients_to_an_all_reduce():
    def body(comm):
        vs = variables([(64, 32)] + [(200,)] * 30)  # 24 KB of small tensors
        grads = [tf.fill(v.shape, float(comm.rank)) for v in vs]
        summed = CompressedGradients(comm, TopK(0.05), error_feedback=False).reduce(grads, vs)
        return summed[1].numpy(), comm.stats.as_dict()["collectives"]

    for workers, collectives in ((2, 1), (4, 2)):  # 4 workers: a gather would move 2x a ring's bytes
        for small_sum, counted in run_ranks(workers, body):
            np.testing.assert_array_equal(small_sum, np.full(200, sum(range(workers)), "float32"))
            assert counted == collectives


def test_powersgd_keeps_q_in_the_reducer_state_keyed_by_variable():
    def body(comm):
        vs = variables([(16, 8)], prefix="layer")
        reducer = CompressedGradients(comm, PowerSGD(rank=2), error_feedback=True, min_compress_bytes=0)
        grad = tf.constant(np.full((16, 8), comm.rank + 1.0, "float32"))
        reducer.reduce([grad], vs)
        return reducer.state.keys()

    keys = run_ranks(2, body)[0]
    assert keys == ["compression_step", "layer0:0/residual", "layer0:0/powersgd_q"]


def test_compressed_warm_up_counts_each_optimizers_updates_on_its_own():
    # A MultiOptimizer's sub-optimizers (or a GAN's two optimizers) update once each per step;
    # one shared counter ended warm-up after half the steps (stop 33).
    warmup = 2
    rng = np.random.default_rng(3)
    local = rng.normal(size=(2, warmup + 1, 2, 64)).astype("float32")  # rank, step, group, entries

    def body(comm):
        groups = [variables([(64,)], prefix="first"), variables([(64,)], prefix="second")]
        reducer = CompressedGradients(comm, TopK(0.05), error_feedback=True, warmup_steps=warmup,
                                      min_compress_bytes=0)
        dense_steps = []
        for t in range(warmup + 1):
            for g, vs in enumerate(groups):
                reducer.before_update(vs)
                [summed] = reducer.reduce([tf.constant(local[comm.rank, t, g])], vs)
                reducer.after_update(vs)
                dense_steps.append(bool(np.allclose(summed.numpy(), local[:, t, g].sum(axis=0), atol=1e-6)))
        return dense_steps, reducer.state.keys(), comm.stats.as_dict()

    for dense_steps, keys, stats in run_ranks(2, body):
        # Updates in order (step 0: first, second; step 1: ...): dense for `warmup` steps of each.
        assert dense_steps == [True, True, True, True, False, False]
        assert keys[:1] == ["compression_step"] and "compression_step_1" in keys
        assert stats["steps"] == 6  # reduced outside a MultiOptimizer: each reduce is a step


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_stale_gradients_apply_the_sum_of_step_t_minus_s_and_settle_the_rest(staleness):
    steps = 5

    def body(comm):
        vs = variables([(2,)])
        reducer = StaleGradients(comm, staleness)
        applied = []
        for t in range(steps):
            grad = tf.constant([float(t), float(comm.rank)])
            reducer.before_update(vs)
            applied.append(reducer.reduce([grad], vs)[0].numpy().tolist())
            reducer.after_update(vs)
        late = []
        reducer.settle(lambda grads, variables, optimizer=None: late.append(grads[0].numpy().tolist()))
        return applied, late, reducer.stats()["max_staleness"]

    for applied, late, max_staleness in run_ranks(2, body):
        sums = [[2.0 * t, 1.0] for t in range(steps)]  # rank 0 sends [t, 0], rank 1 [t, 1]
        assert applied == [[0.0, 0.0]] * staleness + sums[: steps - staleness]
        assert late == sums[steps - staleness:]
        assert max_staleness == staleness


def test_local_sgd_averages_every_h_updates_and_at_settle():
    def body(comm):
        [v] = variables([(1,)])
        reducer = LocalSGD(comm, sync_every=2)
        seen = []
        for step in range(3):
            reducer.before_update([v])
            grads = reducer.reduce([tf.constant([1.0])], [v])
            v.assign_sub(grads[0] * (comm.rank + 1))  # ranks move at different speeds
            reducer.after_update([v])
            seen.append(float(v.numpy()[0]))
        reducer.settle()
        return seen, float(v.numpy()[0]), comm.stats.as_dict()["rounds"]

    (seen0, end0, rounds), (seen1, end1, _) = run_ranks(2, body)
    # Local steps are full steps (loss scaling undone: x2): rank 0 moves 2 per step, rank 1 4.
    # After step 2: rank 0 at -4, rank 1 at -8, both replaced by their average.
    assert seen0[:2] == [-2.0, -6.0] and seen1[:2] == [-4.0, -6.0]
    assert end0 == end1 == -9.0  # step 3 local (-8, -10), averaged again by settle
    assert rounds == 2


def test_local_sgd_follows_a_model_compiled_again_with_other_trainable_variables():
    # Unfreezing a layer and compiling again hands the reducer a longer variable list and a
    # new optimizer: the averages cover the new list, the per-rank optimizer copies the new
    # optimizer's variables only.
    def body(comm):
        a, b = variables([(1,), (2,)])
        reducer = LocalSGD(comm, sync_every=1)
        for trainable, optimizer in (([a], keras.optimizers.SGD(1.0, momentum=0.9)), ([a, b], keras.optimizers.SGD(1.0))):
            optimizer.build(trainable)
            reducer.before_update(trainable, optimizer)
            for v in trainable:
                v.assign_add(tf.fill(v.shape, float(comm.rank)))  # the ranks drift apart
            reducer.after_update(trainable)  # and are averaged (every step: sync_every=1)
            reducer.state.capture(optimizer)
        captured = [k for k in reducer.state.keys() if k.startswith("optimizer/")]
        return a.numpy().tolist(), b.numpy().tolist(), len(captured), len(optimizer.variables)

    (a0, b0, captured, expected), (a1, b1, _, _) = run_ranks(2, body)
    assert a0 == a1 == [1.0]  # 0.5 after the first average, then +0/+1 and averaged again
    assert b0 == b1 == [0.5, 0.5]  # trainable only after compiling again: averaged too
    assert captured == expected == 2  # iterations and learning rate; no momentum of the first optimizer


class DictStore(dict):
    """Stands in for Keras's H5 weights store."""


def test_reducer_state_checkpoint_holds_every_ranks_rows_and_resumes_on_other_worker_counts():
    def save(comm):
        state = ReducerState(comm)
        state.variable("step", lambda: tf.constant(7, tf.int64))
        state.variable("w/residual", lambda: tf.fill([2], float(comm.rank + 1)), per_rank=True)
        state.snapshot()  # every rank, before rank 0 writes
        store = DictStore()
        state.save(store)
        return store

    store = run_ranks(2, save)[0]  # rank 0's checkpoint
    assert store["1"].tolist() == [[1.0, 1.0], [2.0, 2.0]]

    def load(comm):
        state = ReducerState(comm)
        state.load(store)  # before the entries exist: they take the values when created
        step = state.variable("step", lambda: tf.constant(0, tf.int64))
        residual = state.variable("w/residual", lambda: tf.zeros([2]), per_rank=True)
        return int(step.numpy()), residual.numpy().tolist()

    assert run_ranks(2, load) == [(7, [1.0, 1.0]), (7, [2.0, 2.0])]
    # Three workers: each takes the mean of the saved rows, so their sum is unchanged.
    assert run_ranks(3, load) == [(7, [1.0, 1.0])] * 3


def test_reducer_state_without_a_fresh_snapshot_saves_only_this_ranks_row():
    def body(comm):
        state = ReducerState(comm)
        residual = state.variable("r", lambda: tf.zeros([1]), per_rank=True)
        state.snapshot()
        residual.assign([5.0])  # a step after the snapshot: it is stale now
        store = DictStore()
        state.save(store)
        return store["0"].tolist()

    assert run_ranks(2, body)[0] == [[5.0]]


@pytest.mark.parametrize("make", [
    lambda comm: AllReduceGradients(comm),
    lambda comm: CompressedGradients(comm, TopK(1.0), error_feedback=False, min_compress_bytes=0),
    lambda comm: StaleGradients(comm, 0),
    lambda comm: LocalSGD(comm, sync_every=4, warmup_steps=10),
])
def test_rows_weighting_gives_the_global_mean_for_uneven_splits(make):
    # Per-row gradients 1..5; rank 0 holds rows 1-2, rank 1 rows 3-5. Keras hands each rank
    # its mean over its rows divided by 2 replicas; the global mean gradient is 3.
    from tfdp.reducers.base import rows_of_this_step

    rows = {0: [1.0, 2.0], 1: [3.0, 4.0, 5.0]}

    def body(comm):
        [v] = variables([(4,)])
        reducer = make(comm)
        local = tf.fill([4], float(np.mean(rows[comm.rank])) / 2)
        reducer.before_update([v])
        with rows_of_this_step(tf.constant(len(rows[comm.rank]), tf.int64)):
            [applied] = reducer.reduce([local], [v])
        unweighted = reducer.reduce([local], [v])[0]  # outside a Keras step: no weighting
        return applied.numpy(), unweighted.numpy()

    for applied, unweighted in run_ranks(2, body):
        np.testing.assert_allclose(applied, 3.0, rtol=1e-6)
        np.testing.assert_allclose(unweighted, (1.5 + 4.0) / 2, rtol=1e-6)  # negative control: 2.75


@pytest.mark.parametrize("counts, exchanges", [((32, 32), 1), ((32, 31), 2), ((3, 5), 2)])
def test_equal_rows_send_the_plain_sum_once_and_unequal_rows_again_weighted(counts, exchanges):
    # The all-reduce first sends the plain gradients with [rows, rows^2]: equal rows everywhere
    # (every full batch) end there; otherwise every rank runs the row-weighted exchange too.
    from tfdp.reducers.base import rows_of_this_step

    def body(comm):
        [v] = variables([(1000,)])
        local = tf.fill([1000], float(comm.rank + 1))
        with rows_of_this_step(tf.constant(counts[comm.rank], tf.int64)):
            [applied] = AllReduceGradients(comm).reduce([local], [v])
        return applied.numpy(), comm.stats.as_dict()

    rows = np.array(counts, dtype=float)
    expected = 2 * np.sum(rows * np.array([1.0, 2.0])) / rows.sum()  # P x sum(rows g) / sum(rows)
    for applied, stats in run_ranks(2, body):
        np.testing.assert_allclose(applied, expected, rtol=1e-6)
        assert stats["collectives"] == exchanges
        assert stats["gradient_bytes"] == 4000 + 8 + (exchanges - 1) * (4000 + 4)
