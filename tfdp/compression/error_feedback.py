"""Error feedback: remember what compression dropped and send it with the next gradient.

Karimireddy et al., https://arxiv.org/abs/1901.09847. The memory is keyed by variable
path, so it follows the variable, not its position in a list.
"""

import tensorflow as tf

from tfdp._state import local_variable


class ErrorFeedback:
    """Per-variable residual memory.

    Example:
        >>> memory = ErrorFeedback()
        >>> corrected = memory.compensate("dense/kernel", grad)
        >>> payload, ctx = codec.compress(corrected, step)
        >>> memory.update("dense/kernel", corrected, sent=codec.decompress(own(payload), ctx))
    """

    def __init__(self):
        self._residuals = {}

    def _residual(self, key, like):
        if key not in self._residuals:
            self._residuals[key] = local_variable(
                lambda: tf.zeros(like.shape, like.dtype), f"residual_{key}")
        return self._residuals[key]

    def compensate(self, key, grad):
        """Return `grad` plus what was not sent for `key` so far."""
        return grad + self._residual(key, grad)

    def update(self, key, compensated, sent):
        """Keep exactly ``compensated - sent``: what this step did not send."""
        return self._residual(key, compensated).assign(compensated - sent)

    def residual(self, key):
        """Return the current residual of `key` as a tensor."""
        return tf.convert_to_tensor(self._residuals[key])
