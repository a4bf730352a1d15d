"""Per-process state variables that no tf.distribute strategy may mirror or broadcast."""

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def local_variable(initial_value, name):
    """Create a non-trainable variable outside any strategy's variable creator.

    tfdp's own state (counters, error-feedback residuals, PowerSGD's Q) is created
    lazily, sometimes while a Keras step is being traced under a tfdp strategy. Calling
    `ResourceVariable` directly skips the creator stack, so the strategy neither
    broadcasts the value nor checks it against other ranks; `init_scope` lifts the
    creation out of the traced function. Pass `initial_value` as a callable when it
    would otherwise be computed inside a traced function.
    """
    with tf.init_scope(), tf.device("/cpu:0"):
        return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)
