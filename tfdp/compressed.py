"""`tfdp.CompressedStrategy`: synchronous data parallelism with compressed gradients."""

from tfdp.base import HorovodStrategy
from tfdp.compression import RandomK, resolve
from tfdp.compression.reducer import DEFAULT_MIN_COMPRESS_BYTES, CompressedGradients


def compression_reducer_factory(compressor, error_feedback, warmup_steps, min_compress_bytes, op):
    """Validate the compression options; return ``communicator -> CompressedGradients``.

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
    return lambda communicator: CompressedGradients(
        communicator, codec, error_feedback=error_feedback, warmup_steps=warmup_steps,
        min_compress_bytes=min_compress_bytes, op=op)


class CompressedStrategy(HorovodStrategy):
    """Synchronous data parallelism that exchanges compressed gradients.

    Same contract as `tfdp.MirroredStrategy` (fit/evaluate/predict, global metrics, the
    same weights on every rank after every step); only the gradient exchange differs.
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

    Example:
        >>> strategy = tfdp.CompressedStrategy({"name": "topk", "ratio": 0.01})
        >>> with strategy.scope():
        ...     model = build_and_compile_model()
        >>> model.fit(x, y, batch_size=64)
    """

    def __init__(self, compressor="fp16", error_feedback=True, warmup_steps=0,
                 min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, global_step_logs=True):
        make_reducer = compression_reducer_factory(
            compressor, error_feedback, warmup_steps, min_compress_bytes, op="sum")
        super().__init__(make_reducer, global_step_logs=global_step_logs)

    @property
    def codec(self):
        """The compression codec in use."""
        return self.extended.gradient_reducer.codec
