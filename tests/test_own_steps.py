"""Reducers whose workers apply their own step at once: delayed averaging (async presets) and
compression with the residual kept in the worker's model (top-k, EF-sign presets).

On fake ranks in one process. The property both rest on: the mean of the workers' models
moves by the mean of their steps, so on a quadratic (gradients linear in the weights, the
same curvature on every worker) it follows synchronous momentum SGD exactly, whatever the
delay or the compressor; the workers differ only by what has not been averaged yet, and
`settle` leaves every rank with that mean, bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.comm.fake import fake_group, run_ranks
from tfdp.compression import EFSign, TopK
from tfdp.reducers import CompressedGradients, DelayedAveraging, LocalSGD, StaleGradients
from tfdp.reducers.base import variable_key

WORKERS = 2
STEPS = 16
LR, MOMENTUM = 0.1, 0.9
CURVATURE = np.linspace(0.2, 2.0, 64).astype("float32")
TARGETS = np.random.default_rng(0).normal(size=(WORKERS, 64)).astype("float32")


def gradient(weights, rank):
    """This worker's gradient of 0.5 * sum(h * (w - c_rank)^2), divided by the workers as Keras does."""
    return CURVATURE * (weights - TARGETS[rank]) / WORKERS


def synchronous_trajectory():
    """Momentum SGD on the mean of the workers' losses, one process."""
    w, m, trajectory = np.zeros(64, "float32"), np.zeros(64, "float32"), []
    for _ in range(STEPS):
        m = MOMENTUM * m - LR * CURVATURE * (w - TARGETS.mean(axis=0))
        w = w + m
        trajectory.append(w)
    return np.array(trajectory)


def train(make_reducer, settle=True):
    """Every rank's weights after each step (and after `settle`), with Keras's momentum SGD."""

    def body(comm):
        variable = tf.Variable(tf.zeros(64), name="w")
        optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
        reducer = make_reducer(comm)
        seen = []
        for _ in range(STEPS):
            reducer.before_update([variable], optimizer)
            grads = reducer.reduce([tf.constant(gradient(variable.numpy(), comm.rank))], [variable], optimizer)
            optimizer.apply(grads, [variable])
            reducer.after_update([variable])
            seen.append(variable.numpy().copy())
        if settle:
            reducer.settle(lambda grads, variables, applying=None: (applying or optimizer).apply(grads, variables),
                           optimizer)
        return np.array(seen), variable.numpy().copy(), comm.stats.as_dict()

    return run_ranks(WORKERS, body)


def consensus_of(reducer, variable):
    """The local residual's consensus of `variable`, as a NumPy array."""
    return reducer.state.variable(f"{variable_key(variable)}/consensus", None).numpy()


OWN_STEPS = {
    "delayed averaging, s=1": lambda comm: DelayedAveraging(comm, staleness=1),
    "delayed averaging, s=2": lambda comm: DelayedAveraging(comm, staleness=2),
    "top-k 5%, local residual": lambda comm: CompressedGradients(
        comm, TopK(0.05), error_feedback=True, min_compress_bytes=0, local_residual=True),
    "EF-sign, local residual": lambda comm: CompressedGradients(
        comm, EFSign(block=16), error_feedback=True, min_compress_bytes=0, local_residual=True),
}


@pytest.mark.parametrize("name", sorted(OWN_STEPS))
def test_the_mean_of_the_workers_follows_synchronous_momentum_sgd_and_settle_leaves_it_everywhere(name):
    ranks = train(OWN_STEPS[name])
    reference = synchronous_trajectory()
    mean = np.mean([seen for seen, _, _ in ranks], axis=0)
    np.testing.assert_allclose(mean, reference, rtol=0, atol=2e-5)
    # The workers themselves differ while steps are unaveraged (or unsent) ...
    assert np.max(np.abs(ranks[0][0][-1] - ranks[1][0][-1])) > 1e-3
    # ... and end with the mean, bit for bit.
    np.testing.assert_array_equal(ranks[0][1], ranks[1][1])
    np.testing.assert_allclose(ranks[0][1], reference[-1], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name, make", [
    ("stale gradients, s=2", lambda comm: StaleGradients(comm, staleness=2)),
    ("top-k 5% without the local residual", lambda comm: CompressedGradients(
        comm, TopK(0.05), error_feedback=True, min_compress_bytes=0, momentum_correction="update")),
])
def test_negative_control_applying_delayed_or_compressed_sums_leaves_the_synchronous_trajectory(name, make):
    ranks = train(make, settle=False)
    mean = np.mean([seen for seen, _, _ in ranks], axis=0)
    assert np.max(np.abs(mean - synchronous_trajectory())) > 0.05


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_delayed_averaging_swaps_each_own_step_for_the_average_s_steps_later(staleness):
    # Plain SGD with learning rate 1 and gradient -(rank + 1) * (t + 1): own step (rank + 1)(t + 1)
    # scaled by the 2 workers (Keras divided the loss by them), the average 1.5 (t + 1) * 2.
    def body(comm):
        variable = tf.Variable(tf.zeros(1), name="w")
        reducer = DelayedAveraging(comm, staleness)
        seen = []
        for t in range(5):
            reducer.before_update([variable])
            [grad] = reducer.reduce([tf.constant([-(comm.rank + 1.0) * (t + 1)])], [variable])
            variable.assign_sub(grad)
            reducer.after_update([variable])
            seen.append(float(variable.numpy()[0]))
        reducer.settle()
        return seen, float(variable.numpy()[0]), reducer.stats()["max_staleness"]

    for rank, (seen, settled, max_staleness) in enumerate(run_ranks(2, body)):
        own = [2.0 * (rank + 1) * (t + 1) for t in range(5)]
        average = [3.0 * (t + 1) for t in range(5)]
        averaged = [max(0, t + 1 - staleness) for t in range(5)]  # steps whose average has arrived
        expected = [sum(average[:n]) + sum(own[n:t + 1]) for t, n in enumerate(averaged)]
        assert seen == pytest.approx(expected)
        assert settled == pytest.approx(sum(average))
        assert max_staleness == staleness


def test_local_residual_settle_makes_the_average_the_consensus():
    def body(comm):
        reducer = OWN_STEPS["top-k 5%, local residual"](comm)
        variable = tf.Variable(tf.zeros(64), name="w")
        optimizer = keras.optimizers.SGD(LR)
        for _ in range(3):
            reducer.before_update([variable], optimizer)
            grads = reducer.reduce([tf.constant(gradient(variable.numpy(), comm.rank))], [variable], optimizer)
            optimizer.apply(grads, [variable])
            reducer.after_update([variable])
        residual = np.abs(variable.numpy() - consensus_of(reducer, variable)).sum()
        reducer.settle()
        return residual, variable.numpy(), consensus_of(reducer, variable), comm.stats.as_dict()

    ranks = run_ranks(2, body)
    for residual, model, consensus, stats in ranks:
        assert residual > 0  # what compression held back, in this worker's model only
        np.testing.assert_array_equal(model, consensus)
        # Three top-k exchanges (5% of 64 entries: 4 values and 4 indices) and one float32 average.
        assert stats["gradient_bytes"] == 3 * 8 * 4 + 4 * 64
    np.testing.assert_array_equal(ranks[0][1], ranks[1][1])


def _local_residual_top_k(from_entries, steps=5):
    """Each rank's (models, consensus, exchange_entries calls) after `steps` momentum-SGD steps;
    without `from_entries` the local residual takes the general (dense) path."""
    grads = np.random.default_rng(3).standard_t(3, size=(steps, WORKERS, 12, 10)).astype("float32")

    def body(comm):
        reducer = CompressedGradients(comm, TopK(0.1), error_feedback=True, min_compress_bytes=0,
                                      local_residual=True)
        calls = []
        exchange_entries = reducer.codec.exchange_entries
        reducer.codec.exchange_entries = (lambda *args, **kwargs: calls.append(1) or exchange_entries(*args, **kwargs)) \
            if from_entries else None
        variables = [tf.Variable(tf.zeros([12, 10]), name="kernel"), tf.Variable(tf.zeros([10]), name="bias")]
        optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
        for step in range(steps):
            reducer.before_update(variables, optimizer)
            given = [tf.constant(grads[step, comm.rank]), tf.constant(grads[step, comm.rank, 0])]
            optimizer.apply(reducer.reduce(given, variables, optimizer), variables)
            reducer.after_update(variables)
        return [v.numpy() for v in variables], [consensus_of(reducer, v) for v in variables], len(calls)

    return run_ranks(WORKERS, body)


def test_top_k_moves_models_and_consensus_from_its_entries_as_the_dense_path_does():
    entries, dense = _local_residual_top_k(True), _local_residual_top_k(False)
    assert [calls for _, _, calls in entries] == [5, 5] and [calls for _, _, calls in dense] == [0, 0]
    for ranks in (entries, dense):
        np.testing.assert_array_equal(ranks[0][1][0], ranks[1][1][0])  # one consensus, bit for bit
        assert np.max(np.abs(ranks[0][0][0] - ranks[1][0][0])) > 1e-3  # models differ by their residuals
    for (models_e, consensus_e, _), (models_d, consensus_d, _) in zip(entries, dense):
        for a, b in zip(models_e + consensus_e, models_d + consensus_d):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OWN_STEPS))
def test_under_gradient_accumulation_only_the_applying_calls_exchange(name):
    # Keras calls the update every micro-step; with accumulation only every second call applies
    # the accumulated gradients. The reducer exchanges on those calls only.
    def body(comm):
        variable = tf.Variable(tf.zeros(64), name="w")
        optimizer = keras.optimizers.SGD(LR)
        reducer = OWN_STEPS[name](comm)
        def exchanges():  # delayed averaging exchanges in the background: count submissions
            if isinstance(reducer, DelayedAveraging):
                return reducer.pipeline.submitted
            return comm.stats.as_dict()["gradient_bytes"]

        exchanged = []
        for call in range(4):
            applies = call % 2 == 1
            before = exchanges()
            reducer.before_update([variable], optimizer)
            if applies:
                grads = reducer.reduce([tf.constant(gradient(variable.numpy(), comm.rank))], [variable], optimizer)
                optimizer.apply(grads, [variable])
            reducer.after_update([variable], updated=tf.constant(applies))
            exchanged.append(exchanges() > before)
        reducer.settle()
        return exchanged

    for exchanged in run_ranks(WORKERS, body):
        assert exchanged == [False, True, False, True]


def test_a_loss_scaling_skip_on_one_rank_is_a_skip_on_every_rank():
    # Workers that step on their own gradients decide finiteness from their own: rank 1's
    # overflow must reach rank 0, or rank 0 would update (and exchange) alone.
    from tfdp._compat.keras import _non_finite_anywhere_is_non_finite_everywhere

    def body(comm):
        mine = [tf.constant([1.0, float("inf") if comm.rank == 1 else 2.0]), None]
        agreed = _non_finite_anywhere_is_non_finite_everywhere(comm, mine)
        return [bool(np.all(np.isfinite(g.numpy()))) for g in agreed if g is not None], mine[0].numpy()

    (agreed0, own0), (agreed1, _) = run_ranks(2, body)
    assert agreed0 == agreed1 == [False]
    assert np.all(np.isfinite(own0))  # negative control: rank 0's own gradient was finite


def test_finite_gradients_everywhere_pass_unchanged():
    from tfdp._compat.keras import _non_finite_anywhere_is_non_finite_everywhere

    def body(comm):
        return _non_finite_anywhere_is_non_finite_everywhere(comm, [tf.constant([comm.rank + 1.0])])[0].numpy()

    assert [v.tolist() for v in run_ranks(2, body)] == [[1.0], [2.0]]


@pytest.mark.parametrize("name", ["delayed averaging, s=1", "delayed averaging, s=2", "stale gradients, s=1",
                                  "local SGD, H=2"])
def test_two_optimizers_each_get_their_own_exchange(name):
    # A GAN's pattern: two optimizers update two variables of one shape, one after the other,
    # every step. Each variable must receive its own optimizer's sums, never the other's.
    make = {"delayed averaging, s=1": lambda comm: DelayedAveraging(comm, staleness=1),
            "delayed averaging, s=2": lambda comm: DelayedAveraging(comm, staleness=2),
            "stale gradients, s=1": lambda comm: StaleGradients(comm, staleness=1),
            "local SGD, H=2": lambda comm: LocalSGD(comm, sync_every=2)}[name]

    def body(comm):
        reducer = make(comm)
        first, second = tf.Variable([0.0], name="first"), tf.Variable([0.0], name="second")
        for _ in range(5):
            for variable, size in ((first, 1.0), (second, 100.0)):
                reducer.before_update([variable])
                [grad] = reducer.reduce([tf.constant([-size * (comm.rank + 1) / 2])], [variable])
                variable.assign_sub(grad)
                reducer.after_update([variable])
        reducer.settle(lambda grads, variables, applying=None: variables[0].assign_sub(grads[0]))
        return first.numpy()[0], second.numpy()[0]

    # Each step moves `first` by 1.5 on average over the ranks and `second` by 150: whatever the
    # exchange, after settle both ranks hold 5 steps of each, and nothing of the other's.
    for first, second in run_ranks(2, body):
        assert first == pytest.approx(7.5) and second == pytest.approx(750.0)


@pytest.mark.parametrize("traced", [False, True])
def test_the_consensus_starts_from_the_weights_before_the_first_step(traced):
    reducer = CompressedGradients(fake_group(1)[0], TopK(0.1), error_feedback=True,
                                  min_compress_bytes=0, local_residual=True)
    variable = tf.Variable(tf.zeros([100]), name=f"w_traced{traced}")
    optimizer = keras.optimizers.SGD(LR)
    grad = tf.constant(np.random.default_rng(0).normal(size=100).astype("float32"))

    def step():
        reducer.before_update([variable], optimizer)
        optimizer.apply(reducer.reduce([grad], [variable], optimizer), [variable])
        reducer.after_update([variable])

    (tf.function(step) if traced else step)()
    consensus = consensus_of(reducer, variable)
    # The consensus moved by the 10 entries sent of the first step; the model holds the other 90
    # as its residual. Created after the step, it held all 100 and no residual was left.
    assert np.count_nonzero(consensus) == 10
    assert np.count_nonzero(consensus != variable.numpy()) == 90
