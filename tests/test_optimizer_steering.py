"""Reducers steer Keras's own SGD momentum exactly: DGC's update, staleness-aware momentum."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.comm.fake import run_ranks
from tfdp.compression import EFSign, Identity, TopK
from tfdp.reducers import CompressedGradients, StaleGradients
from tfdp.reducers.optimizer_view import gradient_for_momentum, gradient_for_update, next_momentum_buffer, view

STEPS = 6


def gradients(seed, shape=(4, 3)):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=shape).astype("float32")) for _ in range(STEPS)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_gradient_for_update_moves_the_weights_by_minus_lr_delta(nesterov):
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=nesterov)
    w = tf.Variable(tf.zeros([4, 3]))
    replica = tf.zeros([4, 3])
    opt = view(optimizer)
    for delta in gradients(0):
        before = w.numpy()
        g = gradient_for_update(delta, replica, opt)
        optimizer.apply([g], [w])
        replica = next_momentum_buffer(replica, g, opt)
        np.testing.assert_allclose(w.numpy() - before, -0.1 * delta.numpy(), atol=1e-6)
        np.testing.assert_allclose(replica.numpy(), optimizer.momentums[0].numpy(), atol=1e-6)


def test_gradient_for_momentum_steps_as_with_another_momentum():
    steered, reference = keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.SGD(0.1, momentum=0.5)
    a, b = tf.Variable(tf.zeros([4, 3])), tf.Variable(tf.zeros([4, 3]))
    replica, opt = tf.zeros([4, 3]), view(steered)
    for grad in gradients(1):
        g = gradient_for_momentum(grad, replica, opt, 0.5)
        steered.apply([g], [a])
        replica = next_momentum_buffer(replica, g, opt)
        reference.apply([grad], [b])
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    # Negative control: without steering the two part.
    plain = keras.optimizers.SGD(0.1, momentum=0.9)
    c = tf.Variable(tf.zeros([4, 3]))
    for grad in gradients(1):
        plain.apply([grad], [c])
    assert np.max(np.abs(c.numpy() - b.numpy())) > 1e-2


def train_on_fake_ranks(make_reducer, nesterov=False, local_seed=10):
    """Two ranks, each with a Keras SGD(momentum) fed by the reducer; rank r's gradients differ."""
    def body(comm):
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=nesterov)
        w = tf.Variable(tf.zeros([64, 8]), name="w")
        reducer = make_reducer(comm)
        for grad in gradients(local_seed + comm.rank, (64, 8)):
            optimizer.apply(reducer.reduce([grad], [w], optimizer), [w])
        return w.numpy()

    return run_ranks(2, body)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_with_an_exact_codec_is_momentum_sgd(nesterov):
    # Identity sends everything: each worker's velocity sums to the global one, and the
    # weights must follow plain momentum SGD on the summed gradient, step for step.
    corrected = train_on_fake_ranks(
        lambda comm: CompressedGradients(comm, Identity(), error_feedback=True, min_compress_bytes=0,
                                         momentum_correction=True), nesterov)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=nesterov)
    w = tf.Variable(tf.zeros([64, 8]))
    for g0, g1 in zip(gradients(10, (64, 8)), gradients(11, (64, 8))):
        optimizer.apply([g0 + g1], [w])
    for rank_weights in corrected:
        np.testing.assert_allclose(rank_weights, w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec", [TopK(0.05), EFSign()])
def test_momentum_correction_keeps_ranks_identical_and_changes_the_trajectory(codec):
    corrected = train_on_fake_ranks(lambda comm: CompressedGradients(comm, codec, min_compress_bytes=0))
    plain = train_on_fake_ranks(lambda comm: CompressedGradients(comm, codec, min_compress_bytes=0,
                                                                 momentum_correction=False))
    np.testing.assert_array_equal(corrected[0], corrected[1])
    assert np.max(np.abs(corrected[0] - plain[0])) > 1e-3  # "auto" corrects top-k and EF-sign


def test_staleness_momentum_steers_keras_sgd_to_the_lower_momentum():
    # Staleness 0 with momentum 0.5: the applied gradients are the sums, stepped with 0.5.
    steered = train_on_fake_ranks(lambda comm: StaleGradients(comm, 0, momentum=0.5))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
    w = tf.Variable(tf.zeros([64, 8]))
    for g0, g1 in zip(gradients(10, (64, 8)), gradients(11, (64, 8))):
        optimizer.apply([g0 + g1], [w])
    np.testing.assert_allclose(steered[0], w.numpy(), rtol=1e-5, atol=1e-6)


def train_adam_on_fake_ranks(make_reducer):
    """Two ranks, each with a Keras Adam fed by the reducer (op "average": unscaled local losses)."""
    def body(comm):
        optimizer = keras.optimizers.Adam(0.01)
        w = tf.Variable(tf.zeros([64, 8]), name="w")
        reducer = make_reducer(comm)
        for grad in gradients(10 + comm.rank, (64, 8)):
            reducer.before_update([w], optimizer)
            optimizer.apply(reducer.reduce([grad], [w], optimizer), [w])
            reducer.after_update([w])
        return w.numpy(), reducer.compresses_updates

    return run_ranks(2, body)


def test_update_compression_with_an_exact_codec_averages_each_workers_adam_step():
    # Identity sends everything: the weights move by the mean of the two workers' own Adam
    # steps (each worker's moments from its own gradients), step for step.
    ranks = train_adam_on_fake_ranks(lambda comm: CompressedGradients(
        comm, Identity(), min_compress_bytes=0, op="average", momentum_correction="update"))
    optimizers = [keras.optimizers.Adam(0.01) for _ in range(2)]
    local = [tf.Variable(tf.zeros([64, 8])) for _ in range(2)]
    w = np.zeros([64, 8], np.float32)
    for g0, g1 in zip(gradients(10, (64, 8)), gradients(11, (64, 8))):
        steps = []
        for optimizer, variable, grad in zip(optimizers, local, (g0, g1)):
            variable.assign(w)
            optimizer.apply([grad], [variable])
            steps.append(variable.numpy() - w)
        w = w + (steps[0] + steps[1]) / 2
    for weights, compresses_updates in ranks:
        assert compresses_updates
        np.testing.assert_allclose(weights, w, rtol=1e-5, atol=1e-7)


def test_auto_compresses_the_adam_step_for_sparsifiers_only():
    auto = train_adam_on_fake_ranks(lambda comm: CompressedGradients(comm, TopK(0.05), min_compress_bytes=0))
    plain = train_adam_on_fake_ranks(lambda comm: CompressedGradients(comm, TopK(0.05), min_compress_bytes=0,
                                                                       momentum_correction=False))
    cast = train_adam_on_fake_ranks(lambda comm: CompressedGradients(comm, Identity(), min_compress_bytes=0))
    assert auto[0][1] and not plain[0][1] and not cast[0][1]
    np.testing.assert_array_equal(auto[0][0], auto[1][0])
    assert np.max(np.abs(auto[0][0] - plain[0][0])) > 1e-3
