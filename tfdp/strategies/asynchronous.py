"""`tfdp.AsyncStrategy`: bounded-staleness gradients or local SGD across Horovod workers."""

from tfdp.reducers import LocalSGD, StaleGradients
from tfdp.strategies.base import HorovodStrategy

_DAMPING = (None, "lr")


def _check_int(name, value, low):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")


class AsyncStrategy(HorovodStrategy):
    """Data parallelism that does not wait for every exchange: bounded staleness or local SGD.

    Two modes, chosen by which argument is given:

    - ``staleness=s``: each step's gradient all-reduce runs in a background thread while
      the next steps compute; the update at step t applies the summed gradient of step
      t - s (exactly s steps old; ``s=0`` is synchronous). A worker never runs more than
      s steps ahead of the slowest one. The first s steps of each `fit` apply nothing and
      the summed gradients in flight are applied when `fit` ends and before every
      checkpoint tfdp's callbacks write, so none is lost.
    - ``sync_every=H``: local SGD. Each worker takes H optimizer steps on its own
      batches, then the weights are averaged (one all-reduce per H steps), optionally
      after ``warmup_steps`` synchronous steps, and with an outer step (DiLoCo) when
      ``outer_learning_rate != 1`` or ``outer_momentum > 0``. A final average at the
      end of `fit` leaves every rank with the same model.

    Every rank applies the same updates in the same order in staleness mode, so
    weights are identical on all ranks after every step; in local SGD mode they are
    identical after every average. ``communication_stats()`` adds ``max_staleness`` (the
    age in steps of the oldest gradient applied; H - 1 for local SGD) and
    ``blocked_seconds`` (time spent waiting for the staleness bound) and
    ``exchange_seconds`` (time the background exchanges took, delay included).

    Args:
        staleness: s >= 0 (default 1 when `sync_every` is not given).
        sync_every: H >= 1 local steps between model averages.
        warmup_steps: local SGD only: synchronous steps before local steps begin.
        damping: staleness mode only: None, or ``"lr"`` to scale each applied gradient
            by 1 / (1 + s), the staleness-aware learning rate of Zhang et al. 2016.
        momentum: staleness mode, SGD with momentum only: None (the optimizer's own),
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
                 exchange_delay_seconds=0.0, momentum=None):
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
        self.staleness = staleness
        self.sync_every = sync_every

        def make_reducer(communicator):
            if sync_every is not None:
                return LocalSGD(communicator, sync_every, warmup_steps, outer_learning_rate, outer_momentum)
            return StaleGradients(communicator, staleness, damping, exchange_delay_seconds, momentum)

        super().__init__(make_reducer, global_step_logs=global_step_logs)
