"""Gradient compression: codecs, error-feedback memory, a registry by name, the reducer.

Example:
    >>> codec = tfdp.compression.get("topk", ratio=0.01)
    >>> codec = tfdp.compression.resolve({"name": "powersgd", "rank": 4})
"""

from tfdp.compression.codecs import QSGD, Cast, Codec, EFSign, Identity, RandomK, TopK
from tfdp.compression.error_feedback import ErrorFeedback
from tfdp.compression.powersgd import PowerSGD

CODECS = {
    "none": Identity,
    "fp16": lambda: Cast("float16"),
    "bf16": lambda: Cast("bfloat16"),
    "topk": TopK,
    "randomk": RandomK,
    "qsgd": QSGD,
    "efsign": EFSign,
    "powersgd": PowerSGD,
}

__all__ = ["CODECS", "Cast", "Codec", "EFSign", "ErrorFeedback", "Identity", "PowerSGD", "QSGD",
           "RandomK", "TopK", "get", "resolve"]


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


def resolve(compressor):
    """Return a codec from a name, a ``{"name": ..., **params}`` dict, or a codec object.

    Raises:
        ValueError: anything else, an unknown name, or bad parameters.
    """
    if isinstance(compressor, Codec):
        return compressor
    if isinstance(compressor, str):
        return get(compressor)
    if isinstance(compressor, dict) and isinstance(compressor.get("name"), str):
        params = dict(compressor)
        return get(params.pop("name"), **params)
    raise ValueError(
        "`compressor` must be a name such as 'topk', a dict such as "
        "{'name': 'topk', 'ratio': 0.01}, or a tfdp.compression codec. "
        f"Received: compressor={compressor!r}"
    )
