"""Gradient compression: codecs, error-feedback memory and a registry by name.

Status: the codecs and the memory are tested on their own (tests/test_compression.py);
wiring them into a strategy (tfdp.CompressedStrategy) is issue 3's remaining work.

Example:
    >>> codec = tfdp.compression.get("topk", ratio=0.01)
"""

from tfdp.compression.codecs import QSGD, Cast, Identity, RandomK, TopK
from tfdp.compression.error_feedback import ErrorFeedback

CODECS = {
    "none": Identity,
    "fp16": lambda: Cast("float16"),
    "bf16": lambda: Cast("bfloat16"),
    "topk": TopK,
    "randomk": RandomK,
    "qsgd": QSGD,
}

__all__ = ["CODECS", "Cast", "ErrorFeedback", "Identity", "QSGD", "RandomK", "TopK", "get"]


def get(name, **params):
    """Build the codec registered as `name` with `params`.

    Raises:
        ValueError: unknown name (the message lists the choices) or bad parameters.
    """
    if name not in CODECS:
        raise ValueError(f"Unknown compressor {name!r}. Choose one of {sorted(CODECS)}.")
    try:
        return CODECS[name](**params)
    except TypeError as err:
        raise ValueError(f"Bad parameters for compressor {name!r}: {err}") from err
