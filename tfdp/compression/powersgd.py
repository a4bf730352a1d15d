"""PowerSGD: rank-r approximation of each gradient matrix by one step of power iteration.

Vogels et al., https://arxiv.org/abs/1905.13727. Each matrix M (n x m; kernels are
flattened to [prod(shape[:-1]), shape[-1]]) travels as P = M Q (n x r) and then
Q = M^T P_orth (m x r): (n + m) r floats instead of n m. Q is kept between steps (warm
start, kept in the reducer's state and so in checkpoints), so the approximation improves
over steps like a power iteration. Vectors
(biases, norms) and matrices too small to gain go as dense float32.

With ``alternate=True`` each step sends one factor only, P on even steps and Q on odd ones
(ACP-SGD: Zhang et al., "Evaluation and Optimization of Gradient Compression for Distributed
Deep Learning", https://arxiv.org/abs/2306.08881): the step projects every worker's M onto the
subspace the workers agreed on at the previous step (M Q Q^T with Q orthonormalised, then
P P^T M), so one all-reduce per step instead of two dependent ones, and half the bytes.
"""

import tensorflow as tf

from tfdp.compression.codecs import Codec


def matrix_shape(shape):
    """The 2-D view PowerSGD compresses, or None for tensors sent dense."""
    if len(shape) < 2:
        return None
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    return n, int(shape[-1])


class PowerSGD(Codec):
    """Rank-``rank`` gradient compression with a warm-started Q (two all-reduces per step, one with ``alternate``).

    Use it with error feedback (the default of `tfdp.CompressedStrategy`) and a few dense
    warm-up steps. The bytes per matrix are ``(n + m) * rank * 4``. With ``alternate=True``
    a step sends P (``n * rank * 4`` bytes) or Q (``m * rank * 4``) in one all-reduce, by
    the step's parity (see the module docstring).

    Example:
        >>> strategy = tfdp.CompressedStrategy({"name": "powersgd", "rank": 4, "alternate": True},
        ...                                    warmup_steps=50)
    """

    name = "powersgd"
    summable = True

    def __init__(self, rank=4, seed=0, alternate=False):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"`rank` must be an integer >= 1. Received: rank={rank!r}")
        if not isinstance(alternate, bool):
            raise ValueError(f"`alternate` must be True or False. Received: alternate={alternate!r}")
        self.rank = rank
        self.seed = int(seed)
        self.alternate = alternate

    @property
    def rounds(self):
        """Dependent collectives per step."""
        return 1 if self.alternate else 2

    def compresses(self, shape):
        """True if a tensor of `shape` goes as P and Q (fewer bytes than dense)."""
        dims = matrix_shape(shape)
        return dims is not None and (dims[0] + dims[1]) * self.rank < dims[0] * dims[1]

    def payload_bytes(self, shape):
        """Bytes this codec hands to collectives for one tensor of `shape`, per step (with
        ``alternate``, the mean of a P step and a Q step)."""
        if not self.compresses(shape):
            return 4 * int(tf.TensorShape(shape).num_elements())
        n, m = matrix_shape(shape)
        return 4 * (n + m) * self.rank // (2 if self.alternate else 1)

    def _warm_factor(self, state, key, factor, position, rows):
        """The kept factor ``"q"`` (or, alternating, ``"p"``) of the matrix at `position`."""
        # Seeded by position, not by name: every rank starts from the same factor even when
        # its variable names differ.
        seed = [self.seed + (factor == "p"), position]
        return state.variable(f"{key}/powersgd_{factor}",
                              lambda: tf.random.stateless_normal([rows, self.rank], seed=seed))

    def exchange(self, tensors, keys, step, communicator, state=None, plain=()):
        if state is None:
            raise ValueError("PowerSGD keeps Q between steps: pass the reducer's `state`.")
        chosen = [i for i, t in enumerate(tensors) if self.compresses(t.shape)]
        dense = [i for i in range(len(tensors)) if i not in chosen]
        matrices = [tf.reshape(tf.cast(tensors[i], tf.float32), matrix_shape(tensors[i].shape)) for i in chosen]
        qs = [self._warm_factor(state, keys[i], "q", j, m.shape[1]) for j, (i, m) in enumerate(zip(chosen, matrices))]
        riding = [tensors[i] for i in dense] + list(plain)
        if self.alternate:
            ps = [self._warm_factor(state, keys[i], "p", j, m.shape[0]) for j, (i, m) in enumerate(zip(chosen, matrices))]
            return self._exchange_one_factor(tensors, chosen, dense, matrices, ps, qs, riding, step, communicator)

        # Round 1: P = M Q, summed; dense and plain tensors ride along in the same collective.
        ps = [tf.matmul(m, q) for m, q in zip(matrices, qs)]
        round1 = communicator.allreduce(ps + riding, op="sum", gradients=True)
        ps = [tf.linalg.qr(p).q for p in round1[: len(ps)]]
        # Round 2: Q = M^T P_orth, summed. Sum over workers of P_orth Q_w^T is P_orth Q^T.
        local_qs = [tf.matmul(m, p, transpose_a=True) for m, p in zip(matrices, ps)]
        summed_qs = communicator.allreduce(local_qs, op="sum", gradients=True)

        for q, value in zip(qs, summed_qs):
            q.assign(value)
        return _assembled(tensors, chosen, dense,
                          [tf.matmul(p, q, transpose_b=True) for p, q in zip(ps, summed_qs)],
                          [tf.matmul(p, q, transpose_b=True) for p, q in zip(ps, local_qs)], round1[len(ps):])

    def _exchange_one_factor(self, tensors, chosen, dense, matrices, ps, qs, riding, step, communicator):
        """`exchange` with ``alternate``: one all-reduce, of P (even steps) or of Q (odd)."""

        def project(factors, kept, on_the_right):
            # Every rank orthonormalises the same agreed factor, so the subspace is shared and
            # the sum over workers of their projections is the projection of the sum.
            bases = [tf.linalg.qr(f).q for f in factors]
            local = [tf.matmul(m, b, transpose_a=not on_the_right) for m, b in zip(matrices, bases)]
            reduced = communicator.allreduce(local + riding, op="sum", gradients=True)
            agreed = reduced[: len(local)]
            for variable, value in zip(kept, agreed):
                variable.assign(value)

            def approximation(basis, factor):
                if on_the_right:  # M Q Q^T: factor = M Q
                    return tf.matmul(factor, basis, transpose_b=True)
                return tf.matmul(basis, factor, transpose_b=True)  # P P^T M: factor = M^T P

            return _assembled(tensors, chosen, dense, [approximation(b, f) for b, f in zip(bases, agreed)],
                              [approximation(b, f) for b, f in zip(bases, local)], reduced[len(local):])

        return tf.cond(tf.equal(tf.math.floormod(tf.cast(step, tf.int64), 2), 0),
                       lambda: project(qs, ps, on_the_right=True),
                       lambda: project(ps, qs, on_the_right=False))


def _assembled(tensors, chosen, dense, summed_matrices, sent_matrices, riding_summed):
    """`exchange`'s result: the approximations of the `chosen` tensors (summed and this worker's),
    shaped back, then the sums of what rode along: the `dense` tensors, then the plain ones."""
    summed, sent = list(tensors), list(tensors)
    for j, i in enumerate(chosen):
        shape, dtype = tensors[i].shape, tensors[i].dtype
        summed[i] = tf.cast(tf.reshape(summed_matrices[j], shape), dtype)
        sent[i] = tf.cast(tf.reshape(sent_matrices[j], shape), dtype)
    for j, i in enumerate(dense):
        summed[i] = riding_summed[j]
    return summed + list(riding_summed[len(dense):]), sent
