"""Error feedback: remember what compression dropped and send it with the next gradient.

Karimireddy et al., https://arxiv.org/abs/1901.09847. The memory is keyed by variable
path, so it follows the variable, not its position in a list; it lives in the reducer's
`ReducerState`, so checkpoints keep it (one residual per rank).
"""

import tensorflow as tf


class ErrorFeedback:
    """Per-variable residual memory, held in a `tfdp.reducers.state.ReducerState`.

    Example:
        >>> memory = ErrorFeedback(state)
        >>> corrected = memory.compensate("dense/kernel", grad)
        >>> payload, ctx = codec.compress(corrected, step)
        >>> memory.update("dense/kernel", corrected, sent=codec.decompress(codec.own(payload), ctx))
    """

    def __init__(self, state):
        self._state = state

    def _residual(self, key, like):
        return self._state.variable(f"{key}/residual", lambda: tf.zeros(like.shape, like.dtype), per_rank=True)

    def compensate(self, key, grad):
        """Return `grad` plus what was not sent for `key` so far."""
        return grad + self._residual(key, grad)

    def update(self, key, compensated, sent):
        """Keep exactly ``compensated - sent``: what this step did not send."""
        return self._residual(key, compensated).assign(compensated - sent)

    def residual(self, key):
        """Return the current residual of `key` as a tensor."""
        return tf.convert_to_tensor(self._state.variable(f"{key}/residual", None))
