"""`tfdp.AsyncStrategy`: bounded staleness (delayed averaging or stale gradients) or local SGD."""

from tfdp.reducers import DelayedAveraging, LocalSGD, StaleGradients
from tfdp.strategies.base import HorovodStrategy

_DAMPING = (None, "lr")
_METHODS = ("stale_gradients", "delayed_averaging")


def _check_int(name, value, low):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")


class AsyncStrategy(HorovodStrategy):
    """Data parallelism that does not wait for every exchange: bounded staleness or local SGD.

    Two modes, chosen by which argument is given:

    - ``staleness=s``: each step's exchange runs in a background thread while the next
      s steps compute, and a worker never runs more than s steps ahead of the slowest
      one. What travels depends on ``method``:

      - ``"delayed_averaging"`` (the default; DaSGD, Zhou et al.
        https://arxiv.org/abs/2006.00441): each worker applies its own optimizer step at
        once and hands it to the background average; s steps later the workers' average
        replaces it (`tfdp.reducers.DelayedAveraging`). Gradients are always taken at the
        worker's current weights, so momentum SGD and Adam keep their accuracy; the
        workers differ by their last s steps, and each keeps its own optimizer state.
      - ``"stale_gradients"``: every worker applies the summed gradient of step t - s
        (`tfdp.reducers.StaleGradients`); the weights are identical on every rank after
        every step, but the delay costs accuracy with momentum (``momentum`` and
        ``damping`` soften it).

      ``s=0`` is synchronous. What is in flight is applied when `fit` ends and before
      every checkpoint tfdp's callbacks write, so nothing is lost.
    - ``sync_every=H``: local SGD. Each worker takes H optimizer steps on its own
      batches, then the weights are averaged (one all-reduce per H steps), optionally
      after ``warmup_steps`` synchronous steps, and with an outer step (DiLoCo) when
      ``outer_learning_rate != 1`` or ``outer_momentum > 0``.

    When `fit` ends every rank holds the same model (delayed averaging and local SGD
    average the models once more). During `fit`, validation runs each worker's own model
    on its share of the data, except under stale gradients. ``communication_stats()``
    adds ``max_staleness`` (the age in steps of the oldest step or gradient averaged in;
    H - 1 for local SGD), ``blocked_seconds`` (time spent waiting for the staleness
    bound) and ``exchange_seconds`` (time the background exchanges took, delay included).

    Args:
        staleness: s >= 0 (default 1 when `sync_every` is not given).
        method: staleness mode: ``"delayed_averaging"`` (default) or ``"stale_gradients"``.
        sync_every: H >= 1 local steps between model averages.
        warmup_steps: local SGD only: synchronous steps before local steps begin.
        damping: stale gradients only: None, or ``"lr"`` to scale each applied gradient
            by 1 / (1 + s), the staleness-aware learning rate of Zhang et al. 2016.
        momentum: stale gradients, SGD with momentum only: None (the optimizer's own),
            ``"auto"`` (lowered for the momentum staleness adds:
            `tfdp.reducers.stale.staleness_momentum`) or a number in [0, 1).
        outer_learning_rate, outer_momentum: local SGD's outer step.
        global_step_logs: as in `tfdp.MirroredStrategy`, but False by default: a
            per-step metric all-reduce would hold every worker in lockstep.
        exchange_delay_seconds: staleness mode only: sleep this long in each
            background exchange, to emulate a slow link in benchmarks
            (``benchmarks/asynchronous.py``). Leave at 0 for training.

    Example:
        >>> strategy = tfdp.AsyncStrategy(staleness=1)
        >>> with strategy.scope():
        ...     model = build_and_compile_model()
        >>> model.fit(x, y, batch_size=64)
    """

    def __init__(self, staleness=None, sync_every=None, warmup_steps=0, damping=None,
                 outer_learning_rate=1.0, outer_momentum=0.0, global_step_logs=False,
                 exchange_delay_seconds=0.0, momentum=None, method=None):
        if staleness is not None and sync_every is not None:
            raise ValueError("Pass either `staleness` (bounded staleness) or `sync_every` (local SGD), not both.")
        if staleness is None and sync_every is None:
            staleness = 1
        _check_int("staleness", staleness, 0)
        _check_int("sync_every", sync_every, 1)
        _check_int("warmup_steps", warmup_steps, 0)
        if damping not in _DAMPING:
            raise ValueError(f"`damping` must be one of {_DAMPING}. Received: damping={damping!r}")
        if sync_every is None and warmup_steps:
            raise ValueError("`warmup_steps` applies to local SGD (`sync_every`) only.")
        if sync_every is not None and damping is not None:
            raise ValueError("`damping` applies to bounded staleness (`staleness`) only.")
        if momentum is not None and (sync_every is not None or not (
                momentum == "auto" or (isinstance(momentum, (int, float)) and not isinstance(momentum, bool)
                                       and 0 <= momentum < 1))):
            raise ValueError("`momentum` applies to bounded staleness and must be None, 'auto' or a number in "
                             f"[0, 1). Received: momentum={momentum!r}")
        if not isinstance(outer_learning_rate, (int, float)) or outer_learning_rate <= 0:
            raise ValueError(f"`outer_learning_rate` must be > 0. Received: {outer_learning_rate!r}")
        if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
            raise ValueError(f"`outer_momentum` must be in [0, 1). Received: {outer_momentum!r}")
        if not isinstance(exchange_delay_seconds, (int, float)) or exchange_delay_seconds < 0:
            raise ValueError(f"`exchange_delay_seconds` must be >= 0. Received: {exchange_delay_seconds!r}")
        if method is not None and (sync_every is not None or method not in _METHODS):
            raise ValueError(f"`method` applies to bounded staleness and must be one of {_METHODS}. "
                             f"Received: method={method!r}")
        method = method or "delayed_averaging"
        if method == "delayed_averaging" and (damping is not None or momentum is not None):
            raise ValueError("`damping` and `momentum` soften the delay of stale gradients; delayed averaging has "
                             "none to soften. Pass method='stale_gradients' with them, or leave them out.")
        self.staleness = staleness
        self.sync_every = sync_every

        def make_reducer(communicator):
            if sync_every is not None:
                return LocalSGD(communicator, sync_every, warmup_steps, outer_learning_rate, outer_momentum)
            if method == "delayed_averaging":
                return DelayedAveraging(communicator, staleness, exchange_delay_seconds)
            return StaleGradients(communicator, staleness, damping, exchange_delay_seconds, momentum)

        super().__init__(make_reducer, global_step_logs=global_step_logs)
