"""Top-k selection on CPU: the indices of the k entries of largest magnitude, fast.

`largest_magnitudes` finds them as Deep Gradient Compression does (Lin et al.,
https://arxiv.org/abs/1712.01887): a sample of 1% estimates a threshold, and only the entries above
it are ranked. The pass over every entry is one XLA-compiled function (the difference, its
magnitude and the comparison fused, no tensor of magnitudes written), and so are the gathers.
Measured on 3.9 M entries from variables, one thread, medians of 21: the pass with its `tf.where`
5.6 ms against 6.1 ms with TensorFlow's kernels, the gathers of 59 k candidates from two
tensors 3.5 against 4.0 ms; the larger saving is the dense difference never built.

Below 65,536 entries sampling does not pay: `largest_entries` takes `tf.math.top_k` over all of
them, with the magnitudes, the sort of the indices and the gather of their values, in one XLA call.

XLA compiles a function once per input shape, about 50 ms each here. The candidates' count
changes from step to step, so their gather is padded to one length, ``2 k``, for every count up to
it (the sample aims at 1.5 k); a larger count is padded to one of 8 lengths per power of two. A run
then compiles one shape per gradient in its first step, not a new one in each of its first steps
(measured on `tfdp bench`'s CNN, padding to the 8 lengths alone: 43-59 ms in each of the first 5
steps, against 2.6-3.8 ms after).

Example:
    >>> largest_magnitudes(tf.constant([0.5, -3.0, 2.0, 0.1]), 2).numpy().tolist()
    [1, 2]
"""

import tensorflow as tf

#: Below this many entries `tf.math.top_k` over all of them is faster than sampling first (1%
#: selected, of the difference of two variables, medians of 300 calls, a call of nothing 0.5-0.6
#: ms: 0.99 against 1.16 ms at 32,768 entries, 1.60 against 1.32 at 65,536).
SAMPLED_TOP_K_MIN_ENTRIES = 1 << 16


def largest_magnitudes(flat, k, step=0, minus=None):
    """Indices (int32, ascending) of the `k` entries of the 1-D `flat` with the largest magnitude;
    of ``flat - minus`` when `minus` is given, without building that difference.

    A random sample of 1% of the entries (`sample_positions`, drawn from `step`) estimates the
    magnitude above which about 1.5 k entries lie; only those candidates are ranked. The result
    is the exact top k (the candidates are every entry above a threshold, so when there are at
    least k of them they hold the k largest); in the rare step where the sample overestimates and
    fewer than k are found, all entries are ranked. Of entries tied at the k-th largest
    magnitude, the first ones are taken; NaN counts as the largest, so that a NaN reaches the
    weights as it would uncompressed.

    Example:
        >>> largest_magnitudes(tf.constant([0.5, -3.0, 2.0]), 1, minus=tf.constant([0.0, -3.0, 0.0])).numpy()
        array([2], dtype=int32)
    """
    n = int(flat.shape[0])
    if n < SAMPLED_TOP_K_MIN_ENTRIES and isinstance(k, int):
        return largest_entries(flat, k, step, minus)[1]

    def over_all():
        # top_k takes the lower index of tied entries (sorted=True), as `_largest_of` does.
        magnitudes = _nan_largest(tf.abs(flat if minus is None else flat - minus))
        return _of_length(tf.sort(tf.math.top_k(magnitudes, k, sorted=True).indices), k)

    if n < SAMPLED_TOP_K_MIN_ENTRIES:
        return over_all()
    sample_size = max(4096, n // 100)
    sample = magnitudes_at(flat, minus, sample_positions(n, sample_size, step))
    wanted = tf.cast(tf.math.ceil(1.5 * sample_size * tf.cast(k, tf.float64) / n), tf.int32)
    threshold = kth_largest(sample, tf.clip_by_value(wanted, 1, sample_size))
    candidates = tf.cast(tf.where(_magnitude_at_least(flat, minus, threshold))[:, 0], tf.int32)

    def among_candidates():
        return _largest_of(candidates, _gathered(flat, minus, candidates, True, at_least=2 * k), k)

    return tf.cond(tf.size(candidates) >= k, among_candidates, over_all)


def largest_entries(flat, k, step=0, minus=None):
    """``(values, indices)``: the `k` entries of `largest_magnitudes` and their values, as
    `entries_at` gives them.

    Below `SAMPLED_TOP_K_MIN_ENTRIES` entries, with `k` a Python int, this is one XLA-compiled
    call (magnitudes, `top_k`, sort, gather): 0.94 against 1.57 ms for the three calls it
    replaces, at 32,768 entries and k = 328, medians of 500 calls.

    Example:
        >>> [t.numpy().tolist() for t in largest_entries(tf.constant([0.5, -3.0, 2.0]), 2)]
        [[-3.0, 2.0], [1, 2]]
    """
    if int(flat.shape[0]) < SAMPLED_TOP_K_MIN_ENTRIES and isinstance(k, int):
        if minus is None:
            return _top_k_entries_xla(flat, k)
        return _top_k_difference_entries_xla(flat, minus, k)
    indices = largest_magnitudes(flat, k, step, minus)
    return entries_at(flat, minus, indices), indices


def _top_k_entries_of(entries, k):
    # top_k takes the lower index of tied entries (sorted=True), as `_largest_of` does.
    indices = tf.sort(tf.math.top_k(_nan_largest(tf.abs(entries)), k, sorted=True).indices)
    return tf.gather(entries, indices), indices


@tf.function(jit_compile=True)
def _top_k_entries_xla(flat, k):
    return _top_k_entries_of(flat, k)


@tf.function(jit_compile=True)
def _top_k_difference_entries_xla(flat, minus, k):
    return _top_k_entries_of(flat - minus, k)


def sample_positions(n, size, step):
    """The `size` positions (of `n`) `largest_magnitudes` samples at `step`."""
    seed = tf.stack([tf.constant(0x7fd9, tf.int64), tf.cast(step, tf.int64)])
    return tf.random.stateless_uniform([size], seed, maxval=n, dtype=tf.int32)


def entries_at(flat, minus, indices):
    """``(flat - minus)[indices]`` (of `flat` alone when `minus` is None), bit for bit, gathered
    without building the difference."""
    return _gathered(flat, minus, indices, magnitude=False)


def magnitudes_at(flat, minus, indices):
    """``abs(flat - minus)[indices]``, as `entries_at`."""
    return _gathered(flat, minus, indices, magnitude=True)


def kth_largest(magnitudes, k):
    """The `k`-th largest of the 1-D `magnitudes` (NaN the largest), 1 <= k <= size.

    Example:
        >>> float(kth_largest(tf.constant([0.5, 3.0, 2.0, 0.1]), 2))
        2.0
    """
    return _kth_of(_nan_largest(magnitudes), k)


def _kth_of(magnitudes, k):
    return tf.reduce_min(tf.math.top_k(magnitudes, k=k, sorted=False).values)


def _largest_of(positions, magnitudes, k):
    """The `k` of the ascending `positions` whose `magnitudes` are largest, still ascending."""
    magnitudes = _nan_largest(magnitudes)
    kth = _kth_of(magnitudes, k)
    above, tied = magnitudes > kth, magnitudes == kth
    room = k - tf.reduce_sum(tf.cast(above, tf.int32))
    return _of_length(tf.boolean_mask(positions, above | (tied & (tf.cumsum(tf.cast(tied, tf.int32)) <= room))), k)


def _of_length(chosen, k):
    """`chosen`, with its static length `k` when `k` is a Python int (after any warm-up)."""
    return tf.ensure_shape(chosen, [k]) if isinstance(k, int) else chosen


def _nan_largest(magnitudes):
    return tf.where(tf.math.is_nan(magnitudes), tf.constant(float("inf"), magnitudes.dtype), magnitudes)


def _padded_length(count, at_least=0):
    """`count` rounded up to a multiple of an eighth of its power of two (at least 8), or
    `at_least` when `count` is not larger."""
    octave = tf.bitwise.left_shift(1, tf.cast(tf.math.floor(tf.math.log(tf.cast(tf.maximum(count, 8), tf.float32))
                                                           / tf.math.log(2.0)), tf.int32))
    granule = tf.maximum(octave // 8, 1)
    return tf.where(count <= at_least, at_least, (count + granule - 1) // granule * granule)


def _gathered(flat, minus, indices, magnitude, at_least=0):
    count = tf.size(indices)
    padded = tf.pad(indices, [[0, _padded_length(count, at_least) - count]])  # index 0: always in range
    if minus is None:
        gathered = _gathered_xla(flat, padded, magnitude)
    else:
        gathered = _gathered_difference_xla(flat, minus, padded, magnitude)
    return tf.ensure_shape(gathered[:count], indices.shape)


@tf.function(jit_compile=True)
def _gathered_xla(flat, indices, magnitude):
    values = tf.gather(flat, indices)
    return tf.abs(values) if magnitude else values


@tf.function(jit_compile=True)
def _gathered_difference_xla(flat, minus, indices, magnitude):
    values = tf.gather(flat, indices) - tf.gather(minus, indices)
    return tf.abs(values) if magnitude else values


def _magnitude_at_least(flat, minus, threshold):
    if minus is None:
        return _abs_at_least(flat, threshold)
    return _abs_difference_at_least(flat, minus, threshold)


# XLA fuses each into one pass that writes only the booleans; TensorFlow's kernels would write
# the difference and the magnitudes first.
@tf.function(jit_compile=True)
def _abs_at_least(flat, threshold):
    return (tf.abs(flat) >= threshold) | tf.math.is_nan(flat)


@tf.function(jit_compile=True)
def _abs_difference_at_least(flat, minus, threshold):
    difference = flat - minus
    return (tf.abs(difference) >= threshold) | tf.math.is_nan(difference)
