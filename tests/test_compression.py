"""Codecs and error feedback on their own, in-process (no strategy yet)."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import compression
from tfdp.compression import QSGD, Cast, ErrorFeedback, RandomK, TopK


def gradient(n=1000, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=(n // 10, 10)).astype("float32"))


def one_worker(codec, x, step=0):
    """Compress and decompress as a job of one worker would."""
    payload, ctx = codec.compress(x, step)
    if not codec.summable:
        payload = [p[None] for p in payload]  # The all-gather's leading worker axis.
    return codec.decompress(payload, ctx), payload


def test_none_is_exact():
    x = gradient()
    restored, _ = one_worker(compression.get("none"), x)
    np.testing.assert_array_equal(restored.numpy(), x.numpy())


@pytest.mark.parametrize("name, significant_bits", [("fp16", 11), ("bf16", 8)])
def test_casts_halve_bytes_within_rounding(name, significant_bits):
    x = gradient()
    restored, payload = one_worker(compression.get(name), x)
    assert payload[0].dtype.size == 2
    bound = 2.0 ** -significant_bits * np.abs(x.numpy())
    assert np.all(np.abs(restored.numpy() - x.numpy()) <= bound)


def test_topk_keeps_exactly_the_k_largest():
    x = gradient()
    restored, payload = one_worker(TopK(ratio=0.01), x)
    flat, kept = x.numpy().ravel(), restored.numpy().ravel()
    k = 10
    largest = np.argsort(-np.abs(flat))[:k]
    assert np.count_nonzero(kept) == k
    np.testing.assert_array_equal(np.sort(np.nonzero(kept)[0]), np.sort(largest))
    np.testing.assert_array_equal(kept[largest], flat[largest])
    values, indices = payload
    assert values.dtype == tf.float32 and indices.dtype == tf.int32
    assert (values.numpy().nbytes + indices.numpy().nbytes) * 45 <= flat.nbytes * 1.0


def test_topk_sums_gathered_workers():
    a, b = gradient(seed=1), gradient(seed=2)
    codec = TopK(ratio=0.05)
    (pa, ctx), (pb, _) = codec.compress(a, 0), codec.compress(b, 0)
    both = codec.decompress([tf.stack([x, y]) for x, y in zip(pa, pb)], ctx)
    expected = one_worker(codec, a)[0] + one_worker(codec, b)[0]
    np.testing.assert_allclose(both.numpy(), expected.numpy(), rtol=1e-6)


def test_randomk_is_unbiased_and_shared_across_workers():
    x = gradient(200)
    codec = RandomK(ratio=0.1, seed=3)
    # Same (seed, step) -> same indices on every worker: payloads can be summed.
    assert np.array_equal(codec.compress(x, 5)[1][2].numpy(), RandomK(0.1, seed=3).compress(x, 5)[1][2].numpy())
    mean = np.mean([one_worker(codec, x, step)[0].numpy() for step in range(2000)], axis=0)
    # Each entry is kept with p=0.1 and scaled by 10: the mean over 2000 draws has a
    # standard error of |x| * sqrt(9 / 2000) = 0.067 |x|; allow 5 of them.
    assert np.all(np.abs(mean - x.numpy()) <= 5 * 0.067 * np.abs(x.numpy()) + 1e-6)


def test_qsgd_error_within_bound_and_int8_payload():
    x = gradient()
    codec = QSGD(levels=16)
    restored, payload = one_worker(codec, x)
    norm = float(tf.norm(x))
    assert payload[1].dtype == tf.int8
    assert np.max(np.abs(restored.numpy() - x.numpy())) <= norm / 16 + 1e-6


def test_error_feedback_holds_exactly_what_was_not_sent():
    memory, codec = ErrorFeedback(), TopK(ratio=0.01)
    x = gradient()
    corrected = memory.compensate("dense/kernel", x)
    np.testing.assert_array_equal(corrected.numpy(), x.numpy())  # Nothing owed yet.
    sent, _ = one_worker(codec, corrected)
    memory.update("dense/kernel", corrected, sent)
    np.testing.assert_array_equal(memory.residual("dense/kernel").numpy(), (x - sent).numpy())
    # Next step: the residual rides along.
    y = gradient(seed=9)
    np.testing.assert_array_equal(
        memory.compensate("dense/kernel", y).numpy(), (y + memory.residual("dense/kernel")).numpy())


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("topk", {"ratio": 0}, r"`ratio` must be in \(0, 1\]. Received: ratio=0"),
        ("randomk", {"ratio": 1.5}, r"`ratio` must be in \(0, 1\]. Received: ratio=1.5"),
        ("qsgd", {"levels": 0}, r"`levels` must be an integer in \[1, 127\]"),
        ("zip", {}, r"Unknown compressor 'zip'. Choose one of \["),
        ("fp16", {"ratio": 0.1}, r"Bad parameters for compressor 'fp16'"),
    ],
)
def test_invalid_parameters_name_the_valid_range(name, params, message):
    with pytest.raises(ValueError, match=message):
        compression.get(name, **params)


def test_cast_rejects_other_dtypes():
    with pytest.raises(ValueError, match="`dtype` must be 'float16' or 'bfloat16'"):
        Cast("int8")
