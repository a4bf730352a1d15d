"""Gradient codecs: ``compress(x, step) -> (payload, ctx)``, ``decompress``, ``exchange``.

A codec declares how its payloads travel. ``summable`` payloads are summed across
workers by all-reduce and `decompress` turns the sum into a tensor. Other payloads are
all-gathered, each tensor with a leading axis of workers; `decompress` then receives
that stacked payload and returns the sum of every worker's tensor.

`Codec.exchange` runs the whole round for a list of gradients (one collective, which also
carries the small tensors sent uncompressed where it can) and also returns what this worker
sent, which error feedback needs.
Codecs whose exchange takes more than one round or keeps state between steps (PowerSGD)
override it; their state lives in the reducer's `ReducerState`, passed in as `state`.

Example:
    >>> codec = TopK(ratio=0.01)
    >>> payload, ctx = codec.compress(grad, step=0)
    >>> restored = codec.decompress([p[None] for p in payload], ctx)  # one worker
"""

import math

import tensorflow as tf

from tfdp.compression.entries import dense_of_entries
from tfdp.compression.selection import largest_entries


def _check_ratio(ratio):
    if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"`ratio` must be in (0, 1]. Received: ratio={ratio!r}")
    return float(ratio)


class Codec:
    """Base of all codecs: subclasses define `compress`, `decompress` and `summable`."""

    name = "codec"
    summable = True
    #: The dtype of a summable codec's payloads (plain float32 tensors ride with them if it matches).
    payload_dtype = "float32"
    #: Dependent collectives per step (PowerSGD's second round waits on its first).
    rounds = 1
    #: Codecs whose payloads are (index, value) entries define it (top-k): the round of
    #: `exchange` delivered as entries. None: only dense sums (see `TopK.exchange_entries`).
    exchange_entries = None

    def payload_bytes(self, shape):
        """Bytes one worker hands to collectives for a tensor of `shape` (float32 gradients)."""
        raise NotImplementedError

    def travels_by(self, workers, single_host=False):
        """``"allreduce"`` or ``"allgather"``: the collective that carries the payloads among
        `workers` (all on one host with `single_host`)."""
        del workers, single_host
        return "allreduce" if self.summable else "allgather"

    def own(self, payload):
        """Shape `payload` as the exchange would deliver it if this worker were alone."""
        return list(payload) if self.summable else [p[None] for p in payload]

    def exchange(self, tensors, keys, step, communicator, state=None, plain=()):
        """Exchange `tensors` (this worker's gradients, one per key) with every worker.

        `state` is the reducer's `ReducerState`, for codecs that keep state per key. `plain`
        are tensors to sum exactly, uncompressed (gradients too small to compress): they
        travel in the codec's own collective where they can (`plain_rides`).

        Returns:
            (summed, sent): the sums over workers of the decompressed `tensors` and then of
            `plain`, and what this worker's payload of each of `tensors` decompresses to on its own.
        """
        del keys, state  # Stateless: nothing is kept per variable.
        compressed = [self.compress(t, step) for t in tensors]
        sent = [self.decompress(self.own(p), ctx) for p, ctx in compressed]
        delivered, plain_summed = self._deliver(compressed, communicator, plain)
        summed = [self.decompress([next(delivered) for _ in payload], ctx) for payload, ctx in compressed]
        return summed + plain_summed, sent

    def _deliver(self, compressed, communicator, plain=()):
        """Send every ``(payload, ctx)`` of `compressed`, and `plain`, in one collective where
        `plain_rides`; return an iterator over what arrives, payload part by payload
        part, in the order given, and the sums of `plain`."""
        flat = [p for payload, _ in compressed for p in payload]
        if self.summable:
            return _summed_with_plain(flat, plain, communicator)
        return _gathered_with_plain(flat, plain, communicator)


def plain_rides(workers, plain_bytes, summable, same_dtype=True):
    """Whether tensors summed exactly (`plain_bytes` of them) travel in a codec's own collective.

    An all-reduce (`summable`) carries them when every dtype matches (`same_dtype`: Horovod
    groups one dtype). A gather carries them among 2 workers, where it moves the bytes of a
    ring all-reduce, or when they are few: among P workers a gather moves P / 2 times a ring's
    bytes, and one collective fewer saves a round of latency (about a millisecond on loopback here).
    """
    if summable:
        return same_dtype
    return workers <= 2 or plain_bytes <= GATHERED_PLAIN_MAX_BYTES


#: Above this many bytes of plain tensors, a gather among more than 2 workers leaves them to an all-reduce.
GATHERED_PLAIN_MAX_BYTES = 16 << 10


def _rides(payloads, plain, communicator, summable):
    if not plain or not payloads:
        return False
    plain_bytes = sum(t.shape.num_elements() * t.dtype.size for t in plain)
    same_dtype = len({t.dtype for t in [*payloads, *plain]}) == 1
    return plain_rides(communicator.size, plain_bytes, summable, same_dtype)


def _summed_with_plain(flat, plain, communicator):
    plain = list(plain)
    if _rides(flat, plain, communicator, summable=True):
        summed = communicator.allreduce(flat + plain, op="sum", gradients=True)
        return iter(summed[:len(flat)]), summed[len(flat):]
    return (iter(communicator.allreduce(flat, op="sum", gradients=True)),
            communicator.allreduce(plain, op="sum", gradients=True))


def _gathered_with_plain(flat, plain, communicator):
    """`_deliver` for gathered payloads: plain tensors gathered too are summed here, in float32
    order of ranks, the same on every rank."""
    plain = list(plain)
    if _rides(flat, plain, communicator, summable=False):
        gathered = communicator.allgather_stacked(flat + plain, gradients=True)
        return iter(gathered[:len(flat)]), [tf.reduce_sum(g, axis=0) for g in gathered[len(flat):]]
    return (iter(communicator.allgather_stacked(flat, gradients=True)),
            communicator.allreduce(plain, op="sum", gradients=True))


class Identity(Codec):
    """Send float32 gradients unchanged (the reference every codec is measured against)."""

    name = "none"
    summable = True

    def payload_bytes(self, shape):
        return 4 * _numel(shape)

    def compress(self, x, step):
        return [x], x.dtype

    def decompress(self, payload, ctx):
        return tf.cast(payload[0], ctx)


class Cast(Codec):
    """Send gradients as a 16-bit float (``float16`` or ``bfloat16``): 2x fewer bytes.

    float16 keeps 11 significant bits but overflows above 65504; bfloat16 keeps float32's
    range with 8 significant bits. float16 between hosts is all-reduced in float16, as
    Horovod's fp16 compression does; bfloat16 (which Horovod cannot all-reduce), and float16
    when every worker is on one host, travel as 16-bit patterns, gathered from every worker and
    summed in float32 (see `exchange`).
    """

    def __init__(self, dtype):
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"`dtype` must be 'float16' or 'bfloat16'. Received: dtype={dtype!r}")
        self.dtype = tf.as_dtype(dtype)
        self.name = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
        self.payload_dtype = dtype
        self.summable = dtype == "float16"

    def payload_bytes(self, shape):
        return 2 * _numel(shape)

    def compress(self, x, step):
        half = tf.cast(x, self.dtype)
        return [half if self.summable else tf.bitcast(half, tf.uint16)], x.dtype

    def travels_by(self, workers, single_host=False):
        """``"allreduce"`` or ``"allgather"``: how the payloads travel among `workers` (see `exchange`)."""
        del workers
        return "allreduce" if self.summable and not single_host else "allgather"

    def exchange(self, tensors, keys, step, communicator, state=None, plain=()):
        """Gather every worker's 16-bit patterns and sum them in float32, in one collective; but
        all-reduce float16 in float16 between hosts.

        Horovod sums float16 on the CPU 3x slower than float32 (3.4 M entries on loopback: 46 ms
        against 16 ms for float32; 33,802 entries: 2.2 ms against 1.1 ms gathered as 16-bit
        patterns). On one host, where bytes cost memory traffic only, that sum is the cost, and a
        gather avoids it. Between hosts the bytes are the cost: a ring all-reduce moves 2 (P-1)/P
        of them and Horovod's all-gather (P-1), at twice the ring's time on the emulated 100
        Mbit/s link (a gather there took 2.0 s per step against 0.98 s predicted for the all-reduce).
        """
        if self.travels_by(communicator.size, communicator.single_host) == "allreduce":
            return super().exchange(tensors, keys, step, communicator, state, plain)
        halves = [tf.cast(t, self.dtype) for t in tensors]
        gathered, plain_summed = _gathered_with_plain([tf.bitcast(h, tf.uint16) for h in halves], plain, communicator)
        summed = [tf.cast(tf.reduce_sum(tf.cast(tf.bitcast(next(gathered), self.dtype), tf.float32), axis=0), t.dtype)
                  for t in tensors]
        return summed + plain_summed, [tf.cast(h, t.dtype) for h, t in zip(halves, tensors)]

    def decompress(self, payload, ctx):
        if self.summable:
            return tf.cast(payload[0], ctx)
        per_worker = tf.cast(tf.bitcast(payload[0], self.dtype), tf.float32)
        return tf.cast(tf.reduce_sum(per_worker, axis=0), ctx)


def _numel(shape):
    return int(tf.TensorShape(shape).num_elements())


def _k(n, ratio):
    return max(1, int(math.ceil(n * ratio)))


def _check_warmup(warmup_steps):
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be an integer >= 0. Received: warmup_steps={warmup_steps!r}")
    return warmup_steps


def density(ratio, warmup_steps, step):
    """Fraction of entries sent at `step`: DGC's warm-up (Lin et al., https://arxiv.org/abs/1712.01887)
    starts at 25% and sends 4x fewer every quarter of `warmup_steps`, down to `ratio`."""
    if not warmup_steps:
        return ratio
    progress = tf.minimum(tf.cast(step, tf.float32) / warmup_steps, 1.0)
    return tf.maximum(tf.constant(ratio, tf.float32), tf.pow(0.25, 1.0 + 4.0 * progress))


def _k_at(n, ratio, warmup_steps, step):
    """`_k` with the warm-up: a Python int once warmed up, an int32 tensor during it."""
    if not warmup_steps:
        return _k(n, ratio)
    return tf.maximum(1, tf.cast(tf.math.ceil(n * density(ratio, warmup_steps, step)), tf.int32))


class TopK(Codec):
    """Send the ``ratio`` fraction of entries with the largest magnitude, with int32 indices.

    Biased: use it with error feedback (Stich et al., https://arxiv.org/abs/1809.07599),
    which sends the dropped remainder later. 1% is a common starting point; with
    ``warmup_steps`` the fraction starts at 25% and falls to ``ratio`` over those steps.
    """

    name = "topk"
    summable = False

    def __init__(self, ratio=0.01, warmup_steps=0):
        self.ratio = _check_ratio(ratio)
        self.warmup_steps = _check_warmup(warmup_steps)

    def payload_bytes(self, shape):
        return 8 * _k(_numel(shape), self.ratio)  # float32 value + int32 index, once warmed up

    def compress(self, x, step, minus=None):
        """`Codec.compress`; of ``x - minus`` when `minus` (of `x`'s shape) is given, without
        building that difference."""
        flat = tf.reshape(x, [-1])
        flat_minus = None if minus is None else tf.reshape(minus, [-1])
        k = _k_at(int(flat.shape[0]), self.ratio, self.warmup_steps, step)
        values, indices = largest_entries(flat, k, step, flat_minus)
        return [values, indices], (x.shape, x.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        values, indices = (tf.reshape(p, [-1]) for p in payload)  # All workers' pairs.
        return dense_of_entries(indices, values, shape, dtype)

    def exchange_entries(self, tensors, step, communicator, plain=(), minus=None):
        """The round of `exchange`, delivered as entries instead of dense tensors.

        A caller that adds what arrives to variables can then scale the entries and combine
        them with its own and add them in place (`add_entries`), instead of dividing and
        subtracting dense tensors (a pass over every entry each). With `minus` (one tensor per
        tensor), the entries sent are those of ``tensors[i] - minus[i]``, which is never built.

        Returns:
            ``(entries, plain_summed)``: per tensor, ``(indices, values, own_indices, own_values)``,
            every worker's flat int32 indices and values, one worker after the other (adding each
            value at its index, repeats adding up, gives `exchange`'s sum), then this worker's
            (ascending); and the sums of `plain`, as in `exchange`.
        """
        minus = [None] * len(tensors) if minus is None else minus
        compressed = [self.compress(t, step, m) for t, m in zip(tensors, minus)]
        delivered, plain_summed = self._deliver(compressed, communicator, plain)
        entries = []
        for (own_values, own_indices), _ in compressed:
            values, indices = next(delivered), next(delivered)
            entries.append((tf.reshape(indices, [-1]), tf.reshape(values, [-1]), own_indices, own_values))
        return entries, plain_summed


class RandomK(Codec):
    """Send ``ratio`` x n randomly drawn entries, scaled by 1/ratio so the estimate is unbiased.

    Every worker draws the same indices from (`seed`, step), so only values travel and
    they can be summed (Stich et al., https://arxiv.org/abs/1809.07599). ``warmup_steps``
    as for `TopK`.
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio=0.01, seed=0, warmup_steps=0):
        self.ratio = _check_ratio(ratio)
        self.seed = int(seed)
        self.warmup_steps = _check_warmup(warmup_steps)

    def payload_bytes(self, shape):
        return 4 * _k(_numel(shape), self.ratio)  # values only: indices come from the seed

    def _indices(self, n, k, step):
        # k draws with replacement: each draw is an entry with probability 1/n, so scaling by
        # n / k keeps the estimate unbiased (a row drawn twice counts twice), and it costs k
        # random numbers instead of a top_k over n of them.
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        return tf.random.stateless_uniform(tf.reshape(k, [1]), seed=seed, maxval=n, dtype=tf.int32)

    def compress(self, x, step):
        flat = tf.reshape(x, [-1])
        n = int(flat.shape[0])
        k = _k_at(n, self.ratio, self.warmup_steps, step)
        indices = self._indices(n, k, step)
        scale = tf.cast(n / tf.cast(k, tf.float32), x.dtype)
        return [tf.gather(flat, indices) * scale], (x.shape, x.dtype, indices)

    def decompress(self, payload, ctx):
        shape, dtype, indices = ctx
        return dense_of_entries(indices, payload[0], shape, dtype)


class QSGD(Codec):
    """Stochastic quantisation to ``levels`` magnitudes of the vector norm, int8 payload.

    Unbiased; the error of each entry is at most norm/levels
    (Alistarh et al., https://arxiv.org/abs/1610.02132). ``levels`` ≤ 127.
    """

    name = "qsgd"
    summable = False

    def __init__(self, levels=64, seed=0):
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"`levels` must be an integer in [1, 127]. Received: levels={levels!r}")
        self.levels = levels
        self.seed = int(seed)

    def payload_bytes(self, shape):
        return 4 + _numel(shape)  # norm + int8 levels

    def compress(self, x, step):
        flat = tf.reshape(tf.cast(x, tf.float32), [-1])
        norm = tf.norm(flat)
        scaled = tf.math.divide_no_nan(tf.abs(flat), norm) * self.levels
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        noise = tf.random.stateless_uniform(tf.shape(flat), seed=seed)
        level = tf.minimum(tf.floor(scaled + noise), self.levels)
        quantised = tf.cast(tf.sign(flat) * level, tf.int8)
        return [tf.reshape(norm, [1]), quantised], (x.shape, x.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        norms, quantised = payload  # [workers, 1], [workers, n]
        per_worker = tf.cast(quantised, tf.float32) * norms / self.levels
        return tf.cast(tf.reshape(tf.reduce_sum(per_worker, axis=0), shape), dtype)


_BIT_WEIGHTS = tf.constant([[128.0], [64.0], [32.0], [16.0], [8.0], [4.0], [2.0], [1.0]], tf.float32)
_SIGNS_OF_BYTE = tf.constant([[1.0 if (byte >> (7 - bit)) & 1 else -1.0 for bit in range(8)] for byte in range(256)],
                             tf.float32)


def pack_signs(x):
    """Pack the signs of `x` (1 for >= 0) into uint8, 8 per byte, zero-padded."""
    flat = tf.reshape(x, [-1])
    n = int(flat.shape[0])
    bits = tf.pad(tf.cast(flat >= 0, tf.float32), [[0, -n % 8]])
    # A [bytes, 8] x [8, 1] product with the bit weights: one BLAS call, 2x faster on CPU
    # than an integer multiply and sum over the last axis.
    return tf.cast(tf.reshape(tf.matmul(tf.reshape(bits, [-1, 8]), _BIT_WEIGHTS), [-1]), tf.uint8)


def unpack_signs(packed, n):
    """Inverse of `pack_signs` over the last axis: +1/-1 float32, `n` entries."""
    # One gather from a table of the 256 bytes' 8 signs: 3x faster than shifts and masks.
    signs = tf.gather(_SIGNS_OF_BYTE, tf.cast(packed, tf.int32))
    return tf.reshape(signs, tf.concat([tf.shape(packed)[:-1], [-1]], 0))[..., :n]


class EFSign(Codec):
    """Send the sign of each entry (1 bit) and the mean magnitude of each block of entries.

    ``block`` entries share one float32 scale (their mean absolute value); ``block=None``
    uses one scale per tensor (Karimireddy et al.'s scaled sign). Bytes per tensor:
    ``ceil(n / 8) + 4 * ceil(n / block)``, i.e. 28x fewer than float32 at ``block=256``
    and 32x with one scale. Biased on its own; with error feedback it converges like
    SGD (https://arxiv.org/abs/1901.09847), so `tfdp.CompressedStrategy` keeps error
    feedback on for it. Per-block scales follow the local magnitude, which kept
    momentum SGD on digits within the accuracy band where one scale per tensor did not.
    """

    name = "efsign"
    summable = False

    def __init__(self, block=256):
        if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 8
                                  or block % 8):
            raise ValueError(f"`block` must be None or a multiple of 8, >= 8. Received: block={block!r}")
        self.block = block

    def payload_bytes(self, shape):
        n = _numel(shape)
        return -(-n // 8) + 4 * self._blocks(n)

    def _blocks(self, n):
        return 1 if self.block is None else -(-n // self.block)

    def compress(self, x, step):
        flat = tf.reshape(tf.cast(x, tf.float32), [-1])
        n = int(flat.shape[0])
        width = n if self.block is None else self.block
        padded = tf.pad(tf.abs(flat), [[0, self._blocks(n) * width - n]])
        # Mean over the real entries of each block (the last block may be short).
        counts = tf.constant([min(width, n - b * width) for b in range(self._blocks(n))], tf.float32)
        scales = tf.reduce_sum(tf.reshape(padded, [-1, width]), axis=1) / counts
        return [scales, pack_signs(flat)], (x.shape, x.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        scales, packed = payload  # [workers, blocks], [workers, ceil(n / 8)]
        n = shape.num_elements()
        width = n if self.block is None else self.block
        blocks = self._blocks(n)
        signs = unpack_signs(packed, min(n, blocks * width))
        signs = tf.pad(signs, [[0, 0], [0, blocks * width - n]])  # the last block may be short
        # Each block's signs times its scale, by broadcasting (no per-entry copy of the scales).
        per_worker = tf.reshape(tf.reshape(signs, [-1, blocks, width]) * scales[:, :, None], [-1, blocks * width])
        return tf.cast(tf.reshape(tf.reduce_sum(per_worker, axis=0)[:n], shape), dtype)
