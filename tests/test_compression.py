"""Codecs, error feedback and the compressed reducer in one process (no horovodrun).

At one worker every collective is the identity, so exchanges here show exactly what
one worker's payload decompresses to.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import compression
import tfdp
from tfdp.comm.fake import fake_group, run_ranks
from tfdp.compression import QSGD, Cast, EFSign, ErrorFeedback, PowerSGD, RandomK, TopK
from tfdp.compression.codecs import pack_signs, unpack_signs
import keras

from tfdp.compression.entries import add_entries
from tfdp.compression import selection
from tfdp.compression.selection import entries_at, largest_entries, largest_magnitudes, sample_positions
from tfdp.reducers import CompressedGradients, ReducerState


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


@pytest.mark.parametrize("single_host, first", [(True, 80_000.0), (False, np.inf)])  # float16 overflows above 65504
def test_fp16_is_summed_in_float32_on_one_host_and_all_reduced_in_float16_between_hosts(single_host, first):
    from tfdp.comm.fake import run_ranks

    def body(comm):
        comm.single_host = single_host
        summed, sent = Cast("float16").exchange([tf.constant([40_000.0, 0.1])], ["w"], 0, comm)
        return summed[0].numpy(), sent[0].numpy(), comm.stats.as_dict()

    for summed, sent, stats in run_ranks(2, body):
        assert summed[0] == first
        np.testing.assert_allclose(summed[1], 2 * np.float16(0.1), rtol=1e-3)
        assert sent[1] == np.float32(np.float16(0.1))  # what this worker's payload stands for
        assert stats["collectives"] == 1 and stats["payload_bytes"] == 4  # 2 entries, 2 bytes each


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


@pytest.mark.parametrize("n, ratio", [(200_000, 0.01), (70_000, 0.001), (300_000, 0.05)])
def test_sampled_threshold_top_k_finds_exactly_the_k_largest(n, ratio):
    rng = np.random.default_rng(n)
    flat = rng.standard_t(3, size=n).astype("float32")  # heavy tails, as gradients have
    k = int(np.ceil(n * ratio))
    expected = np.sort(np.argpartition(-np.abs(flat), k)[:k])
    for step in range(5):  # another sample every step
        found = np.sort(largest_magnitudes(tf.constant(flat), k, step).numpy())
        np.testing.assert_array_equal(found, expected)
    # Also inside a traced function, with k a tensor (as during the warm-up).
    traced = tf.function(lambda x, k: largest_magnitudes(x, k, tf.constant(3)))
    np.testing.assert_array_equal(np.sort(traced(tf.constant(flat), tf.constant(k)).numpy()), expected)


def test_sampled_threshold_top_k_falls_back_when_the_sample_overestimates():
    # The entries the sample will look at are the largest: its threshold lets through only
    # about 1.5 k x 4,096 / 100,000 of them, fewer than k, and top_k runs over all entries.
    n, k = 100_000, 2000
    flat = np.random.default_rng(0).uniform(0, 1, n).astype(np.float32)
    sampled = np.unique(sample_positions(n, 4096, 0).numpy())
    flat[sampled] += 10.0
    threshold_count = np.count_nonzero(flat >= np.sort(flat[sampled])[-int(np.ceil(1.5 * 4096 * k / n))])
    assert threshold_count < k  # the candidates would be too few: the fallback must run
    expected = np.sort(np.argpartition(-flat, k)[:k])
    np.testing.assert_array_equal(np.sort(largest_magnitudes(tf.constant(flat), k, 0).numpy()), expected)


def test_the_candidates_gather_keeps_one_shape_from_step_to_step(monkeypatch):
    # Each new shape is an XLA compilation (about 50 ms): the candidates' count changes every
    # step, their padded length must not. The CNN's dense kernel: 294,912 entries, a sample of
    # 4,096, so the count varies by about 13% around 1.5 k.
    n, k = 294_912, 2950
    rng = np.random.default_rng(11)
    lengths = []
    gathered = selection._gathered

    def spy(flat, minus, indices, magnitude, at_least=0):
        count = tf.size(indices)
        lengths.append((int(count), int(selection._padded_length(count, at_least)),
                        int(selection._padded_length(count))))
        return gathered(flat, minus, indices, magnitude, at_least)

    monkeypatch.setattr(selection, "_gathered", spy)
    traces = selection._gathered_xla.experimental_get_tracing_count()
    for step in range(12):
        flat = rng.standard_t(3, size=n).astype("float32")
        expected = np.sort(np.argpartition(-np.abs(flat), k)[:k])
        np.testing.assert_array_equal(largest_magnitudes(tf.constant(flat), k, step).numpy(), expected)
    candidates = [(c, padded, eighths) for c, padded, eighths in lengths if c != 4096]  # not the sample
    assert len(candidates) == 12 and max(c for c, _, _ in candidates) <= 2 * k
    assert {padded for _, padded, _ in candidates} == {2 * k}
    assert len({eighths for _, _, eighths in candidates}) >= 3  # the control: 8 lengths per octave
    assert selection._gathered_xla.experimental_get_tracing_count() - traces <= 2  # the sample's, the candidates'


@pytest.mark.parametrize("n", [5_000, 300_000])
def test_top_k_of_a_difference_is_the_top_k_of_the_tensor_it_never_builds(n):
    rng = np.random.default_rng(7)
    a, b = (rng.standard_t(3, size=n).astype("float32") for _ in range(2))
    k = n // 100
    difference = a - b
    expected = np.sort(np.argpartition(-np.abs(difference), k)[:k])
    for step in range(3):
        found = largest_magnitudes(tf.constant(a), k, step, minus=tf.constant(b)).numpy()
        np.testing.assert_array_equal(found, expected)  # ascending, as returned
        values = entries_at(tf.constant(a), tf.constant(b), tf.constant(found)).numpy()
        np.testing.assert_array_equal(values, difference[found])  # bit for bit
        # Both at once (one XLA call below 65,536 entries): the same entries, the same bits.
        values, indices = largest_entries(tf.constant(a), k, step, minus=tf.constant(b))
        np.testing.assert_array_equal(indices.numpy(), found)
        np.testing.assert_array_equal(values.numpy(), difference[found])
        values, indices = largest_entries(tf.constant(a), k, step)
        np.testing.assert_array_equal(indices.numpy(), np.sort(np.argpartition(-np.abs(a), k)[:k]))
        np.testing.assert_array_equal(values.numpy(), a[indices.numpy()])


@pytest.mark.parametrize("n", [100_000, 30_000])  # sampled; top_k over all entries
def test_top_k_takes_the_first_of_tied_entries_and_counts_nan_as_largest(n):
    flat = np.ones(n, np.float32)
    flat[[7, n - 1000]] = 2.0
    np.testing.assert_array_equal(largest_magnitudes(tf.constant(flat), 5).numpy(), [0, 1, 2, 7, n - 1000])
    minus = np.zeros(n, np.float32)
    minus[[1, 2]] = 1.0  # of the difference: those two are 0 now, and no longer among the first tied
    np.testing.assert_array_equal(largest_magnitudes(tf.constant(flat), 5, minus=tf.constant(minus)).numpy(),
                                  [0, 3, 4, 7, n - 1000])
    flat[50] = np.nan
    np.testing.assert_array_equal(largest_magnitudes(tf.constant(flat), 3).numpy(), [7, 50, n - 1000])


@pytest.mark.parametrize("make", [tf.Variable, keras.Variable], ids=["tf", "keras"])
def test_entries_are_added_into_each_variable_in_place(make):
    indices = np.array([5, 0, 5, 11], np.int32)
    values = np.array([1.5, -2.0, 0.25, 4.0], np.float32)
    first, second = make(np.zeros((3, 4), np.float32)), make(np.full((3, 4), 10.0, np.float32))
    expected_first, expected_second = np.zeros(12, np.float32), np.full(12, 10.0, np.float32)
    for _ in range(2):  # the second call reuses the compiled function
        add_entries(first, tf.constant(indices), tf.constant(values))
        np.add.at(expected_first, indices, values)
    add_entries(second, tf.constant(indices), tf.constant(values))  # same shape, another variable
    np.add.at(expected_second, indices, values)
    np.testing.assert_array_equal(np.asarray(first).ravel(), expected_first)
    np.testing.assert_array_equal(np.asarray(second).ravel(), expected_second)


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
    memory, codec = ErrorFeedback(ReducerState(one_worker_communicator())), TopK(ratio=0.01)
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
        ("powersgd", {"rank": 0}, r"`rank` must be an integer >= 1. Received: rank=0"),
        ("qsgd", {"levels": 128}, r"`levels` must be an integer in \[1, 127\]"),
        ("efsign", {"block": 12}, r"`block` must be None or a multiple of 8"),
    ],
)
def test_invalid_parameters_name_the_valid_range(name, params, message):
    with pytest.raises(ValueError, match=message):
        compression.get(name, **params)


def test_cast_rejects_other_dtypes():
    with pytest.raises(ValueError, match="`dtype` must be 'float16' or 'bfloat16'"):
        Cast("int8")


def test_sign_packing_round_trips_with_8_signs_per_byte():
    x = tf.constant(np.random.default_rng(4).normal(size=37).astype("float32"))
    packed = pack_signs(x)
    assert packed.dtype == tf.uint8 and packed.shape == (5,)  # ceil(37 / 8)
    np.testing.assert_array_equal(unpack_signs(packed, 37).numpy(), np.where(x.numpy() >= 0, 1.0, -1.0))


@pytest.mark.parametrize("block, scales", [(None, 1), (256, 4), (64, 16)])
def test_efsign_sends_signs_and_block_means(block, scales):
    x = gradient()  # 1000 entries
    restored, payload = one_worker(EFSign(block=block), x)
    flat = x.numpy().ravel()
    width = 1000 if block is None else block
    means = np.repeat([np.mean(np.abs(flat[i:i + width])) for i in range(0, 1000, width)], width)[:1000]
    np.testing.assert_allclose(restored.numpy().ravel(), np.where(flat >= 0, means, -means), rtol=1e-5)
    assert sum(p.numpy().nbytes for p in payload) == 1000 // 8 + 4 * scales


def test_efsign_sums_gathered_workers():
    a, b = gradient(seed=1), gradient(seed=2)
    codec = EFSign()
    (pa, ctx), (pb, _) = codec.compress(a, 0), codec.compress(b, 0)
    both = codec.decompress([tf.stack([x, y]) for x, y in zip(pa, pb)], ctx)
    np.testing.assert_allclose(both.numpy(), (one_worker(codec, a)[0] + one_worker(codec, b)[0]).numpy(),
                               rtol=1e-6)


def one_worker_communicator():
    return fake_group(1)[0]


def variables(*tensors):
    return [tf.Variable(tf.zeros_like(t), name=f"v{i}") for i, t in enumerate(tensors)]


def test_powersgd_is_exact_on_a_matrix_of_its_rank_and_warm_starts():
    rng = np.random.default_rng(5)
    low_rank = tf.constant((rng.normal(size=(64, 2)) @ rng.normal(size=(2, 48))).astype("float32"))
    bias = tf.constant(rng.normal(size=48).astype("float32"))
    codec, state = PowerSGD(rank=2), ReducerState(one_worker_communicator())
    q0 = codec._warm_factor(state, "w", "q", 0, 48).numpy()
    summed, sent = codec.exchange([low_rank, bias], ["w", "b"], 0, state.communicator, state)
    np.testing.assert_allclose(summed[0].numpy(), low_rank.numpy(), atol=1e-4)
    np.testing.assert_array_equal(summed[1].numpy(), bias.numpy())  # Vectors go dense.
    np.testing.assert_allclose(sent[0].numpy(), summed[0].numpy(), atol=1e-5)  # One worker.
    assert codec.payload_bytes(low_rank.shape) == (64 + 48) * 2 * 4
    assert codec.payload_bytes(bias.shape) == 48 * 4
    # Warm start: the Q kept for the next step is M^T orth(M Q0).
    p_orth = np.linalg.qr(low_rank.numpy() @ q0)[0]
    kept_q = state.variable("w/powersgd_q", None).numpy()
    np.testing.assert_allclose(np.abs(kept_q), np.abs(low_rank.numpy().T @ p_orth), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("alternate, steps", [(False, 30), (True, 60)])
def test_powersgd_error_shrinks_over_steps_on_a_fixed_matrix(alternate, steps):
    # Power iteration: with a warm-started Q the rank-2 approximation of a fixed
    # full-rank matrix approaches the best rank-2 one (the truncated SVD). Alternating,
    # a step is half an iteration.
    m = tf.constant(np.random.default_rng(6).normal(size=(40, 30)).astype("float32"))
    codec, errors, state = PowerSGD(rank=2, alternate=alternate), [], ReducerState(one_worker_communicator())
    for step in range(steps):
        summed, _ = codec.exchange([m], ["w"], step, state.communicator, state)
        errors.append(float(tf.norm(m - summed[0])))
    u, s, vt = np.linalg.svd(m.numpy())
    best = np.linalg.norm(m.numpy() - (u[:, :2] * s[:2]) @ vt[:2])
    assert errors[-1] < errors[0]
    assert errors[-1] <= best * 1.01


def test_alternating_powersgd_sends_one_factor_a_step_and_is_exact_once_it_has_both_subspaces():
    # Two workers whose gradients are rank-2 matrices in the same row and column spaces: step 0
    # projects onto a random Q (not exact), step 1 onto P = orth(sum M Q), the column space
    # (exact), step 2 onto Q = sum M^T P, the row space (exact). One all-reduce a step, of P
    # (64 x 2) or Q (48 x 2) and the bias riding with it.
    rng = np.random.default_rng(7)
    left, right = rng.normal(size=(64, 2)), rng.normal(size=(2, 48))
    grads = [(left @ rng.normal(size=(2, 2)) @ right).astype("float32") for _ in range(2)]
    biases = rng.normal(size=(2, 48)).astype("float32")

    def body(comm):
        codec, state = PowerSGD(rank=2, alternate=True), ReducerState(comm)
        steps = []
        for step in range(3):
            before = comm.stats.as_dict()
            summed, sent = codec.exchange([tf.constant(grads[comm.rank])], ["w"], tf.constant(step, tf.int64),
                                          comm, state, plain=[tf.constant(biases[comm.rank])])
            after = comm.stats.as_dict()
            steps.append(([t.numpy() for t in summed], sent[0].numpy(),
                          after["collectives"] - before["collectives"], after["payload_bytes"] - before["payload_bytes"]))
        return steps

    ranks = run_ranks(2, body)
    total = grads[0] + grads[1]
    for step, ((summed, sent0, collectives, nbytes), (summed1, sent1, _, _)) in enumerate(zip(*ranks)):
        assert collectives == 1
        assert nbytes == (64 * 2 if step % 2 == 0 else 48 * 2) * 4 + 48 * 4
        np.testing.assert_array_equal(summed[0], summed1[0])  # the same on both ranks
        np.testing.assert_array_equal(summed[1], biases[0] + biases[1])  # the bias exact
        np.testing.assert_allclose(sent0 + sent1, summed[0], atol=1e-4)  # a projection is linear
        error = np.linalg.norm(summed[0] - total) / np.linalg.norm(total)
        assert (error > 0.1) if step == 0 else (error < 1e-5), (step, error)
    assert PowerSGD(2, alternate=True).payload_bytes((64, 48)) == (64 + 48) * 2 * 4 // 2
    assert PowerSGD(2, alternate=True).rounds == 1 and PowerSGD(2).rounds == 2


def test_reducer_error_feedback_sends_everything_eventually():
    # A constant gradient under top-k with error feedback: every entry is delivered
    # within n / k steps, so the average delivered gradient approaches the gradient.
    x = gradient(100)
    reducer = CompressedGradients(one_worker_communicator(), TopK(ratio=0.1), error_feedback=True,
                                  min_compress_bytes=0)
    v = variables(x)
    delivered = [reducer.reduce([x], v)[0].numpy() for _ in range(50)]
    np.testing.assert_allclose(np.mean(delivered, axis=0), x.numpy(), atol=np.abs(x.numpy()).max() * 0.25)
    without = CompressedGradients(one_worker_communicator(), TopK(ratio=0.1), error_feedback=False,
                                  min_compress_bytes=0)
    dropped = np.mean([without.reduce([x], v)[0].numpy() for _ in range(50)], axis=0)
    assert np.count_nonzero(dropped) == 10  # Negative control: the same 10 entries forever.


def test_reducer_warmup_is_dense_then_compressed_and_small_tensors_stay_dense():
    x, bias = gradient(1000), tf.constant(np.arange(1.0, 11.0, dtype="float32"))
    reducer = CompressedGradients(one_worker_communicator(), TopK(ratio=0.01), error_feedback=False,
                                  warmup_steps=2, min_compress_bytes=1024)
    v = variables(x, bias)
    for _ in range(2):
        dense, dense_bias = reducer.reduce([x, bias], v)
        np.testing.assert_array_equal(dense.numpy(), x.numpy())
    sparse, sparse_bias = reducer.reduce([x, bias], v)
    assert np.count_nonzero(sparse.numpy()) == 10
    np.testing.assert_array_equal(sparse_bias.numpy(), bias.numpy())  # 40 bytes < 1024: dense.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compressor": "zip"}, r"Unknown compressor 'zip'"),
        ({"compressor": 3}, r"`compressor` must be a name such as 'topk'"),
        ({"compressor": {"name": "topk", "ratio": -1}}, r"`ratio` must be in \(0, 1\]"),
        ({"compressor": "randomk"}, r"Pass error_feedback=False with randomk"),
        ({"compressor": "fp16", "warmup_steps": -1}, r"`warmup_steps` must be an integer >= 0"),
        ({"compressor": "fp16", "error_feedback": "yes"}, r"`error_feedback` must be True or False"),
    ],
)
def test_compressed_strategy_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdp.CompressedStrategy(**kwargs)
