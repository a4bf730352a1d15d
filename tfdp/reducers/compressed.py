"""`CompressedGradients`: the gradient reducer of `tfdp.CompressedStrategy`."""

import tensorflow as tf

from tfdp._compat.tensorflow import local_variable
from tfdp.compression import RandomK, resolve
from tfdp.compression.entries import add_entries
from tfdp.compression.error_feedback import ErrorFeedback
from tfdp.reducers.base import GradientReducer, update_group, variable_key
from tfdp.reducers.optimizer_view import gradient_for_update, next_momentum_buffer
from tfdp.reducers.optimizer_view import view as optimizer_view
from tfdp.reducers.state import ReducerStateSaveable

DEFAULT_MIN_COMPRESS_BYTES = 1024


_SPARSIFYING = ("topk", "randomk")
# Codecs whose error grows with momentum unless the momentum is corrected (DGC).
_MOMENTUM_CORRECTED = ("topk", "randomk", "efsign")
# Lossy codecs whose error an adaptive optimizer's per-entry scaling distorts: compress the step.
_UPDATE_COMPRESSED = ("topk", "randomk", "efsign", "qsgd")
MOMENTUM_CORRECTION = (True, False, "auto", "update")


class CompressedGradients(GradientReducer):
    """Compress each large gradient, exchange the payloads, apply the decompressed sum.

    Every rank decompresses the same delivered payloads in the same order, so all ranks
    apply the same gradient and their weights stay identical (but with ``local_residual``,
    below). Its state (error-feedback
    residuals, the codec's state, local velocities, the step counter that drives the
    warm-up) is saved with the optimizer.

    Momentum correction (Lin et al., Deep Gradient Compression, https://arxiv.org/abs/1712.01887):
    under SGD with momentum, each worker accumulates its velocity (not its raw gradient)
    into the residual, sends the compressed accumulation, zeroes the velocity where it sent
    (factor masking, for sparsifiers), and the weights move by ``-lr`` times the summed
    payloads; the optimizer's own momentum is steered to apply exactly that (Nesterov too).
    When the optimizer clips, each worker clips its own gradient first, at the threshold
    divided by sqrt(workers), and Keras does not clip again.

    Update compression, for adaptive optimizers (Adam, AdamW, RMSprop, ...): Adam divides
    each entry by the root of its own second moment, so an entry that error feedback holds
    back for k steps and then releases moves about one step, not k, and a sparsifier slows
    training by its sparsity. Under such an optimizer each worker instead takes the
    optimizer's step on its own gradient (its moments are its own, saved per rank), and the
    workers exchange that step, compressed with error feedback: the weights move by the
    average of the delivered steps, identical on every rank, and what compression held back
    of each worker's step follows later in full. Under plain SGD the two are the same thing.

    ``momentum_correction`` picks among these: ``"auto"`` uses DGC for top-k, random-k and
    EF-sign under momentum SGD, update compression for those and QSGD under any optimizer
    that is not `keras.optimizers.SGD`, and the raw gradient otherwise; ``True`` forces
    DGC under momentum SGD, ``"update"`` forces update compression, ``False`` turns both off.

    Local residual (``local_residual=True``, any optimizer; the "error reset" of CSER, Xie et
    al., https://arxiv.org/abs/2007.13221): update compression where each worker also keeps in
    its own model what compression held back of its steps, ``w_i = consensus + residual_i``.
    A worker's step counts in its own model at once, and the workers' mean moves by the mean
    of their steps every step: for a quadratic that is synchronous (momentum) SGD exactly,
    whatever the compressor; compression only sets how far the workers drift apart (their
    residuals). Error feedback holds back most of a top-k or sign step for many steps, which
    cost 3-5 points of accuracy in runs of 150 steps; this does not. `settle` (end of `fit`,
    before checkpoints, before `evaluate`/`predict` outside `fit`) averages the models (one
    float32 all-reduce of the weights) and resets the residuals. Needs error feedback (the
    residual is its memory).

    Args:
        communicator: a `tfdp.comm.Communicator`.
        codec: a `tfdp.compression` codec.
        error_feedback: add to each gradient what compression dropped from it before.
        warmup_steps: exchange dense float32 gradients for this many first steps.
        min_compress_bytes: gradients smaller than this (as float32) go dense.
        op: ``"sum"`` (losses already divided by the number of workers, as under a
            strategy) or ``"average"``.
        momentum_correction: ``"auto"``, True, ``"update"`` or False (see above).
        state: as in `GradientReducer`.
        local_residual: keep what compression held back in each worker's model (see above).

    Example:
        >>> reducer = CompressedGradients(communicator, TopK(0.01), error_feedback=True)
        >>> grads = reducer.reduce(grads, variables, optimizer)
    """

    def __init__(self, communicator, codec, error_feedback=True, warmup_steps=0,
                 min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, op="sum", momentum_correction="auto", state=None,
                 local_residual=False):
        super().__init__(communicator, op, state)
        self.local_residual = local_residual
        if momentum_correction not in MOMENTUM_CORRECTION:
            raise ValueError(f"`momentum_correction` must be one of {MOMENTUM_CORRECTION}. "
                             f"Received: momentum_correction={momentum_correction!r}")
        self.codec = codec
        self.memory = ErrorFeedback(self.state) if error_feedback else None
        # A residual kept from one step to the next must not change scale with a step's rows.
        self.weights_rows = self.memory is None
        self.warmup_steps = warmup_steps
        self.min_compress_bytes = min_compress_bytes
        self.momentum_correction = momentum_correction
        self._step_counters = {}  # update group -> its step counter (see `_count_steps_of`)
        self._updates_compressed = {}  # update group -> whether its optimizer's updates are compressed
        self._group = None  # the update group of the update being traced
        self._step = self.state.variable("compression_step", lambda: tf.constant(0, tf.int64))
        self._corrected = None  # (positions, keys, compressed-now flag) of the step being traced
        self._compresses_updates = False
        self._before_update = None  # the variables' values before the update of the step being traced
        self._consensus_variables = {}  # local residual: id -> (variable, its consensus)
        # Local residual: steps since the models were last averaged (the workers' models differ).
        self._unsettled_steps = local_variable(tf.constant(0, tf.int64), "tfdp_unsettled_steps")

    def _compresses_updates_of(self, opt):
        if self.momentum_correction == "update" or self.local_residual:
            return True
        return self.momentum_correction == "auto" and opt.adaptive and self.codec.name in _UPDATE_COMPRESSED

    @property
    def compresses_updates(self):
        """True once the reducer compresses each worker's optimizer step (update compression)."""
        return self._compresses_updates

    def _configure(self, opt, variables):
        """Choose gradient or update compression for the optimizer that applies the result, and
        make `_step` its step counter."""
        self._count_steps_of(variables)
        self._compresses_updates = self._compresses_updates_of(opt)
        # Each worker's optimizer steps on its own gradient: its moments differ per rank. With
        # several optimizers (a MultiOptimizer's), the state of all is kept per rank if any's differs.
        self._updates_compressed[self._group] = self._compresses_updates
        self.optimizer_state_per_rank = any(self._updates_compressed.values())
        self.weights_rows = self.memory is None and not self._compresses_updates

    def saveable(self, optimizer):
        # Called while the optimizer is being built, before its settings exist; whether the
        # workers' optimizer states differ is decided at the first update. Restoring per-rank
        # optimizer state is a no-op when none was saved.
        return ReducerStateSaveable(self.state, optimizer)

    def reduce(self, grads, variables, optimizer=None):
        self._configure(optimizer_view(optimizer), variables)
        return super().reduce(grads, variables, optimizer)

    def _count_steps_of(self, variables):
        """Make `_step` the step counter of the optimizer that updates `variables`.

        Warm-up and the codecs' sampling count each optimizer's own updates: a MultiOptimizer's
        sub-optimizers (or a GAN's two optimizers) update once each per training step, and one
        shared counter would end warm-up after half the steps. Counters are made in the order of
        first update, the same on every rank; the first keeps the name of earlier checkpoints.
        """
        self._group = update_group(list(variables))
        if self._group not in self._step_counters:
            n = len(self._step_counters)
            self._step_counters[self._group] = self._step if n == 0 else self.state.variable(
                f"compression_step_{n}", lambda: tf.constant(0, tf.int64))
        self._step = self._step_counters[self._group]

    def _corrects(self, opt):
        if opt.momentum == 0 or self.momentum_correction in (False, "update"):
            return False
        return self.momentum_correction is True or self.codec.name in _MOMENTUM_CORRECTED

    def replaces_clipping(self, optimizer):
        opt = optimizer_view(optimizer)
        return self._corrects(opt) and opt.clips

    def _clip_locally(self, grads, opt):
        """DGC's local clipping: each worker's own gradient, at the threshold / sqrt(workers)."""
        size = self.communicator.size
        # Under a strategy (op "sum") each gradient is the local mean's divided by `size`.
        scale = (1.0 / size if self.op == "sum" else 1.0) / size ** 0.5
        if opt.global_clipnorm:
            return list(tf.clip_by_global_norm(grads, opt.global_clipnorm * scale)[0])
        return [tf.clip_by_norm(g, opt.clipnorm * scale) for g in grads]

    def _velocity(self, key, like):
        return self.state.variable(f"{key}/velocity", lambda: tf.zeros(like.shape, like.dtype), per_rank=True)

    def _accumulate(self, key, variable, grad, opt, step):
        """DGC's momentum correction: this worker's velocity, what goes into its residual."""
        velocity = self._velocity(key, grad)
        mu = tf.cast(opt.momentum, grad.dtype)
        if self.warmup_steps:
            # Leaving dense warm-up: each worker starts from its share of the optimizer's momentum.
            share = -self._optimizer_momentum(key, variable) / (tf.cast(opt.learning_rate(), grad.dtype)
                                                                * self._shares())
            velocity.assign(tf.where(step == self.warmup_steps, share, velocity))
        if opt.nesterov:
            updated = velocity.assign(mu * (velocity + grad))
            return updated + grad
        return velocity.assign(mu * velocity + grad)

    def _shares(self):
        return float(self.communicator.size) if self.op == "sum" else 1.0

    def _optimizer_momentum(self, key, variable):
        """A copy of the optimizer's momentum buffer (the same on every rank)."""
        return self.state.variable(f"{key}/optimizer_momentum", lambda: tf.zeros(variable.shape, variable.dtype))

    def _compressed(self, grads, keys, variables, step, opt, correct, feedback=True, plain=()):
        """The codec's exchange of `grads` (and of `plain`, summed exactly: see `Codec.exchange`)."""
        if correct:
            grads = [self._accumulate(k, v, g, opt, step) for k, v, g in zip(keys, variables, grads)]
        memory = self.memory if feedback else None
        if memory is not None:
            grads = [memory.compensate(k, g) for k, g in zip(keys, grads)]
        summed, sent = self.codec.exchange(grads, keys, step, self.communicator, self.state, plain)
        if memory is not None:
            for k, g, s in zip(keys, grads, sent):
                self.memory.update(k, g, s)
            if correct and self.codec.name in _SPARSIFYING:
                for k, s in zip(keys, sent):  # momentum factor masking
                    velocity = self._velocity(k, s)
                    velocity.assign(tf.where(tf.not_equal(s, 0), tf.zeros_like(velocity), velocity))
        return summed, sent

    def _reduce(self, grads, variables, opt):
        if self._compresses_updates:
            return self._local_step(grads, variables)
        correct = self._corrects(opt)
        if correct and opt.clips:
            grads = self._clip_locally(grads, opt)
        result, _ = self._exchange(grads, variables, opt, correct)
        return [g / self.communicator.size for g in result] if self.op == "average" else result

    def _local_step(self, grads, variables):
        """Update compression: this worker's optimizer steps on its own gradient."""
        self._corrected = None
        # Under a strategy Keras divided each worker's loss by the number of workers.
        return [g * self.communicator.size for g in grads] if self.op == "sum" else grads

    def before_update(self, variables, optimizer=None):
        """Update compression: remember the weights before this worker's step (read before the
        optimizer writes: automatic control dependencies keep program order). A local residual
        needs no copy: the consensus it keeps is the reference."""
        self._configure(optimizer_view(optimizer), variables)
        if self._compresses_updates:
            self._before_update = [] if self.local_residual else [tf.identity(tf.convert_to_tensor(v))
                                                                  for v in variables]
        if self.local_residual:
            # Created from the weights before the first step, the same on every rank. Created at
            # the first exchange instead, an eager loop (run_eagerly=True) started each rank's
            # consensus from its own first step, and the ranks never agreed on one.
            for variable in variables:
                self._consensus(variable)

    def after_update(self, variables, updated=None):
        """Update compression: exchange each worker's step; every rank moves by their average
        (with `local_residual`, each worker also keeps what compression held back of its own)."""
        if not self._compresses_updates or self._before_update is None:
            return
        before, self._before_update = self._before_update, None
        variables = list(variables)
        if self.local_residual:
            exchange = lambda: self._exchange_with_consensus(variables)  # noqa: E731
        else:
            exchange = lambda: self._exchange_steps(variables, before)  # noqa: E731
        if updated is None:
            exchange()
        else:  # gradient accumulation: only the calls that apply the accumulated gradients
            tf.cond(updated, exchange, lambda: tf.constant(False))

    def _exchange_steps(self, variables, before):
        steps = [tf.convert_to_tensor(v) - b for v, b in zip(variables, before)]
        summed, _ = self._exchange(steps, variables, None, correct=False)
        for variable, start, total in zip(variables, before, summed):
            variable.assign(start + total / self.communicator.size)
        return tf.constant(True)

    def _consensus(self, variable):
        """The weights every rank agrees on: the worker's own model minus its residual."""
        return self.state.variable(f"{variable_key(variable)}/consensus",
                                   lambda: tf.identity(tf.convert_to_tensor(variable)))

    def _exchange_with_consensus(self, variables):
        """Local residual: send (compressed) what this model is ahead of the consensus, i.e. its
        steps since and what compression held back before; the consensus moves by the average of
        what arrives, the model by that minus what it sent. Its residual is model minus consensus,
        error feedback without a variable of its own, and no copy of the weights before the step."""
        consensus = [self._consensus(v) for v in variables]
        self._consensus_variables.update((id(v), (v, c)) for v, c in zip(variables, consensus))
        self._unsettled_steps.assign_add(1)
        if self.codec.exchange_entries is not None and not self.warmup_steps:
            self._move_by_entries(variables, consensus)
            return tf.constant(True)
        ahead = [tf.convert_to_tensor(v) - c for v, c in zip(variables, consensus)]
        summed, sent = self._exchange(ahead, variables, None, correct=False, feedback=False)
        for variable, agreed, total, own in zip(variables, consensus, summed, sent):
            average = total / self.communicator.size
            agreed.assign_add(average)
            variable.assign_add(average - own)
        return tf.constant(True)

    def _move_by_entries(self, variables, consensus):
        """`_exchange_with_consensus` for a sparsifier: the same sums, built from the entries.

        The large tensors' entries are chosen from model and consensus (what the model is ahead
        is never built dense), and what arrives is scaled (k x workers values), joined by this
        worker's own with a minus sign, and added into the variables in place."""
        large, small = self._split(variables)
        step = tf.convert_to_tensor(self._step)
        small_ahead = [tf.convert_to_tensor(variables[i]) - consensus[i] for i in small]
        entries, summed_small = self.codec.exchange_entries(
            [tf.convert_to_tensor(variables[i]) for i in large], step, self.communicator, plain=small_ahead,
            minus=[tf.convert_to_tensor(consensus[i]) for i in large])
        self._step.assign_add(1)
        size = self.communicator.size
        for i, (indices, values, own_indices, own_values) in zip(large, entries):
            average = values / size
            add_entries(consensus[i], indices, average)
            add_entries(variables[i], tf.concat([indices, own_indices], 0), tf.concat([average, -own_values], 0))
        for i, ahead, total in zip(small, small_ahead, summed_small):
            average = total / size
            consensus[i].assign_add(average)
            variables[i].assign_add(average - ahead)

    def _split(self, grads):
        """Positions of the gradients large enough to compress, and of the rest."""
        large = [i for i, g in enumerate(grads) if tf.TensorShape(g.shape).num_elements() * 4 >= self.min_compress_bytes]
        return large, [i for i in range(len(grads)) if i not in large]

    def _exchange(self, grads, variables, opt, correct, feedback=True):
        """The summed exchange of `grads` (one per variable): the large ones compressed after
        any dense warm-up steps (with error feedback unless `feedback` is False), the small ones
        dense; counts the step. Returns the sums and what this worker's payloads stand for."""
        large, small = self._split(grads)
        step = tf.convert_to_tensor(self._step)
        keys = [variable_key(variables[i]) for i in large]
        chosen = [grads[i] for i in large]
        plain = [grads[i] for i in small]

        # The small gradients travel with the compressed payloads where the codec can carry them:
        # one collective fewer per step.
        def compressed():
            return self._compressed(chosen, keys, [variables[i] for i in large], step, opt, correct, feedback,
                                    plain)

        def dense():
            return self.communicator.allreduce(chosen + plain, op="sum", gradients=True), list(chosen)

        if not chosen:
            summed, sent_large = self.communicator.allreduce(plain, op="sum", gradients=True), []
        elif self.warmup_steps > 0:
            summed, sent_large = tf.cond(step < self.warmup_steps, dense, compressed)
        else:
            summed, sent_large = compressed()
        summed_large, summed_small = summed[:len(large)], summed[len(large):]
        self._step.assign_add(1)
        self._corrected = (large, keys, step >= self.warmup_steps) if correct else None

        result, sent = list(grads), list(grads)
        for i, g, own in zip(large, summed_large, sent_large):
            result[i], sent[i] = g, own
        for i, g in zip(small, summed_small):
            result[i] = g
        return result, sent

    def unsettled(self):
        return self.communicator.size > 1 and int(self._unsettled_steps.numpy()) > 0

    def settle(self, apply_gradients=None, optimizer=None):
        """With `local_residual`: average the workers' models once; that average is the
        consensus from then on (the residuals' mean is in it)."""
        if not self.unsettled():
            return
        self._unsettled_steps.assign(0)
        pairs = list(self._consensus_variables.values())
        self.communicator.stats.add("rounds", 1)
        averaged = self.communicator.allreduce([tf.convert_to_tensor(v) for v, _ in pairs], op="average",
                                               gradients=True)
        for (variable, agreed), value in zip(pairs, averaged):
            variable.assign(value)
            agreed.assign(value)

    def _after_reduce(self, grads, variables, opt):
        if self._corrected is None:
            return grads
        positions, keys, compressed_now = self._corrected
        for i, key in zip(positions, keys):
            delta = grads[i]
            momentum = self._optimizer_momentum(key, variables[i])
            # Compressed steps: the weights move by -lr * delta. Dense warm-up steps: as given.
            grads[i] = tf.where(compressed_now, gradient_for_update(delta, momentum, opt), delta)
            momentum.assign(next_momentum_buffer(momentum, grads[i], opt))
        return grads


def compressed_reducer_factory(compressor, error_feedback, warmup_steps, min_compress_bytes, op,
                               momentum_correction="auto", local_residual=False):
    """Validate the compression options; return ``(communicator, state=None) -> CompressedGradients``.

    Shared by `CompressedStrategy` and `tfdp.DistributedOptimizer(compression=...)`.
    """
    codec = resolve(compressor)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"`error_feedback` must be True or False. Received: error_feedback={error_feedback!r}")
    if error_feedback and isinstance(codec, RandomK):
        raise ValueError(
            "randomk scales what it sends by 1/ratio, so its error is larger than the gradient "
            "and error feedback would diverge. Pass error_feedback=False with randomk."
        )
    for name, value in (("warmup_steps", warmup_steps), ("min_compress_bytes", min_compress_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"`{name}` must be an integer >= 0. Received: {name}={value!r}")
    if momentum_correction not in MOMENTUM_CORRECTION:
        raise ValueError(f"`momentum_correction` must be one of {MOMENTUM_CORRECTION}. "
                         f"Received: momentum_correction={momentum_correction!r}")
    if not isinstance(local_residual, bool):
        raise ValueError(f"`local_residual` must be True or False. Received: local_residual={local_residual!r}")
    if local_residual and not error_feedback:
        raise ValueError("`local_residual=True` keeps what compression held back in each worker's model: it is "
                         "error feedback's memory. Pass error_feedback=True with it, or local_residual=False.")
    return lambda communicator, state=None: CompressedGradients(
        communicator, codec, error_feedback=error_feedback, warmup_steps=warmup_steps,
        min_compress_bytes=min_compress_bytes, op=op, momentum_correction=momentum_correction, state=state,
        local_residual=local_residual)
