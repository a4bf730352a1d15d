"""What a reducer needs to know of the Keras optimizer it feeds, and how to steer its momentum.

Keras's SGD keeps a momentum buffer m and applies ``m = mu*m - lr*g; w += m`` (Nesterov:
``w += mu*m - lr*g``). A reducer that wants the weights to move by ``-lr*delta`` (DGC's
momentum-corrected update) or with another momentum (staleness-aware momentum) does not
touch the optimizer: it hands it the gradient ``g`` that makes its own update come out
that way, and keeps a copy of m (the same on every rank) to compute it. Saved models
therefore still hold the user's optimizer, with its own settings.
"""

from dataclasses import dataclass

import keras
import tensorflow as tf


@dataclass(frozen=True)
class OptimizerView:
    momentum: float  # 0 for optimizers without SGD momentum (Adam keeps its own moments)
    nesterov: bool
    clipnorm: float | None
    global_clipnorm: float | None
    learning_rate: object  # a callable returning the current learning rate (a tensor)
    adaptive: bool = False  # not Keras's SGD: an optimizer with per-entry step sizes (Adam, RMSprop, ...)
    clipvalue: float | None = None

    @property
    def linear_in_slices(self):
        """True when the update depends on an IndexedSlices gradient only through its dense sum.

        Keras applies IndexedSlices row by row: Adam squares each duplicate row before adding,
        `clip_by_norm` measures the rows with their duplicates. Only SGD without clipping is
        unchanged when duplicate rows are summed first.
        """
        return not self.adaptive and not self.clips and not self.clipvalue

    @property
    def clips(self):
        return bool(self.clipnorm) or bool(self.global_clipnorm)


NO_OPTIMIZER = OptimizerView(0.0, False, None, None, lambda: tf.constant(1.0))


def view(optimizer):
    """The `OptimizerView` of a Keras optimizer, or of none.

    A LossScaleOptimizer's gradients reach the reducer still multiplied by the loss scale,
    so its momentum is not steered (momentum 0 here); clipping settings are its inner one's.
    """
    if optimizer is None:
        return NO_OPTIMIZER
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    is_sgd = isinstance(inner, keras.optimizers.SGD) and inner is optimizer
    return OptimizerView(
        momentum=float(inner.momentum) if is_sgd else 0.0,
        nesterov=bool(inner.nesterov) if is_sgd else False,
        clipnorm=inner.clipnorm, global_clipnorm=inner.global_clipnorm,
        learning_rate=lambda: tf.convert_to_tensor(inner.learning_rate),
        adaptive=not isinstance(inner, keras.optimizers.SGD), clipvalue=inner.clipvalue)


def gradient_for_update(delta, m, opt):
    """The gradient that makes Keras's SGD (momentum buffer `m`) move the weights by ``-lr * delta``."""
    lr = tf.cast(opt.learning_rate(), delta.dtype)
    mu = tf.cast(opt.momentum, delta.dtype)
    if opt.nesterov:  # mu * (mu*m - lr*g) - lr*g = -lr*delta
        return (delta + mu * mu * m / lr) / (1 + mu)
    return delta + mu * m / lr  # mu*m - lr*g = -lr*delta


def gradient_for_momentum(grad, m, opt, momentum):
    """The gradient that makes Keras's SGD step as if its momentum were `momentum` (a float)."""
    lr = tf.cast(opt.learning_rate(), grad.dtype)
    return grad + tf.cast(opt.momentum - momentum, grad.dtype) * m / lr


def next_momentum_buffer(m, grad, opt):
    """Keras's SGD momentum buffer after a step with gradient `grad`."""
    lr = tf.cast(opt.learning_rate(), grad.dtype)
    return tf.cast(opt.momentum, grad.dtype) * m - lr * grad
