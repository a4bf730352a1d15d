"""`tfdp.CompressedStrategy`: synchronous data parallelism with compressed gradients."""

from tfdp.reducers import DEFAULT_MIN_COMPRESS_BYTES, compressed_reducer_factory
from tfdp.strategies.base import HorovodStrategy


class CompressedStrategy(HorovodStrategy):
    """Synchronous data parallelism that exchanges compressed gradients.

    Same contract as `tfdp.MirroredStrategy` (fit/evaluate/predict, global metrics, the
    same weights on every rank after every step); only the gradient exchange differs. With
    ``local_residual=True`` the workers' models differ during `fit` by what compression
    has not sent yet, and are averaged when `fit` ends (and before checkpoints).
    ``strategy.communication_stats()`` reports ``gradient_bytes`` (every byte of
    gradient payload handed to collectives: values, indices, scales, norms) next to
    ``dense_bytes`` (what float32 all-reduce would have sent); see
    `tfdp.callbacks.CommunicationLogger` to log them per step.

    Args:
        compressor: a name (``none``, ``fp16``, ``bf16``, ``topk``, ``randomk``,
            ``qsgd``, ``efsign``, ``powersgd``), a dict ``{"name": "topk", "ratio":
            0.01}``, or a `tfdp.compression` codec object.
        error_feedback: keep what compression dropped, per variable, and add it to the
            next gradient. Needed by the biased compressors (topk, efsign, powersgd);
            must be False for randomk.
        warmup_steps: first steps exchanged as dense float32.
        min_compress_bytes: gradients smaller than this as float32 go dense (biases).
        global_step_logs: as in `tfdp.MirroredStrategy`.
        momentum_correction: under SGD with momentum, accumulate each worker's velocity
            rather than its gradient in the residual and steer the optimizer's momentum
            (Deep Gradient Compression); ``"auto"``: for top-k, random-k and EF-sign. See
            `tfdp.reducers.CompressedGradients`.
        balance: as in `tfdp.MirroredStrategy`; only with ``error_feedback=False``
            (a residual kept across steps is not weighted by rows).
        local_residual: each worker takes its own optimizer step, the workers exchange their
            steps compressed with error feedback, and each keeps in its own model what
            compression held back of its steps (CSER's error reset): the mean of the workers
            follows synchronous training; the preset ``topk-1pct`` and ``efsign`` use it. See
            `tfdp.reducers.CompressedGradients`.

    Example:
        >>> strategy = tfdp.CompressedStrategy({"name": "topk", "ratio": 0.01})
        >>> with strategy.scope():
        ...     model = build_and_compile_model()
        >>> model.fit(x, y, batch_size=64)
    """

    def __init__(self, compressor="fp16", error_feedback=True, warmup_steps=0,
                 min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, global_step_logs=True, momentum_correction="auto",
                 balance=None, local_residual=False):
        make_reducer = compressed_reducer_factory(
            compressor, error_feedback, warmup_steps, min_compress_bytes, op="sum",
            momentum_correction=momentum_correction, local_residual=local_residual)
        super().__init__(make_reducer, global_step_logs=global_step_logs, balance=balance)

    @property
    def codec(self):
        """The compression codec in use."""
        return self.extended.gradient_reducer.codec
