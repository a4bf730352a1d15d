"""Every hook tfdp puts into private Keras code, in one place.

Each patch names the Keras file it depends on; `tests/test_compat.py` fails
loudly if one of those hooks moves. `install()` is idempotent.
"""

import contextlib
import functools
import threading

_installed = False
_state = threading.local()


def gradient_reducer(optimizer):
    """Return the reducer that manages `optimizer`'s gradients, or None.

    A `tfdp.DistributedOptimizer` carries its own; otherwise the reducer comes from
    the tfdp strategy the optimizer was created under.
    """
    reducer = getattr(optimizer, "_tfdp_gradient_reducer", None)
    if reducer is not None:
        return reducer
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return getattr(getattr(strategy, "extended", None), "gradient_reducer", None)


@contextlib.contextmanager
def gradients_reduced():
    """Within this block, optimizers apply the gradients they are given as they are."""
    previous = getattr(_state, "reduced", False)
    _state.reduced = True
    try:
        yield
    finally:
        _state.reduced = previous


def _reducer_to_apply(optimizer):
    """`optimizer`'s reducer, or None when there is none or the gradients are already reduced."""
    if getattr(_state, "reduced", False):
        return None
    return gradient_reducer(optimizer)


def _reduce_first(method):
    """Wrap `method(self, grads, ...)` so that grads are reduced across workers first."""

    @functools.wraps(method)
    def wrapper(self, grads, *args, **kwargs):
        reducer = _reducer_to_apply(self)
        if reducer is None:
            return method(self, grads, *args, **kwargs)
        grads = reducer(list(grads))
        with gradients_reduced():
            return method(self, grads, *args, **kwargs)

    wrapper._tfdp_original = method
    return wrapper


def _skip_nonfinite_counter(optimizer):
    """The strategy's skipped-step counter when it skips non-finite steps, else None."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return getattr(getattr(strategy, "extended", None), "skipped_steps", None)


def _update_unless_nonfinite(method, optimizer, grads, trainable_variables, counter):
    """Reduce, then run the update only if every reduced gradient is finite; else count a skip.

    The reduced gradients are identical on every rank (a NaN or Inf on any rank is one in
    the sum), so every rank takes the same branch: one global decision, no extra collective.
    """
    import tensorflow as tf

    if optimizer.gradient_accumulation_steps:
        raise ValueError("`skip_nonfinite=True` does not support `gradient_accumulation_steps`; "
                         "use a larger batch, or skip_nonfinite=False.")
    reducer = _reducer_to_apply(optimizer)
    if reducer is not None:
        grads = reducer(list(grads))
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])

    def update():
        with gradients_reduced():
            method(optimizer, grads, trainable_variables)
        return tf.constant(True)

    def skip():
        counter.assign_add(1)
        return tf.constant(False)

    return tf.cond(finite, update, skip)


def _notify_after_update(method):
    """Wrap `_backend_apply_gradients(self, grads, variables)` to tell the reducer an update ran.

    With a strategy built with ``skip_nonfinite=True`` the update runs only when the
    reduced gradients are all finite.
    """

    @functools.wraps(method)
    def wrapper(self, grads, trainable_variables):
        counter = _skip_nonfinite_counter(self)
        if counter is not None:
            result = _update_unless_nonfinite(method, self, grads, trainable_variables, counter)
        else:
            result = method(self, grads, trainable_variables)
        hook = getattr(gradient_reducer(self), "after_update", None)
        if hook is not None:
            if self.gradient_accumulation_steps:
                raise ValueError(
                    "tfdp.AsyncStrategy does not support `gradient_accumulation_steps`; "
                    "use a larger batch or tfdp.MirroredStrategy."
                )
            hook(trainable_variables)
        return result

    wrapper._tfdp_original = method
    return wrapper


def _skip_keras_all_reduce(method):
    @functools.wraps(method)
    def wrapper(self, grads_and_vars):
        if gradient_reducer(self) is not None:
            return list(grads_and_vars)
        return method(self, grads_and_vars)

    wrapper._tfdp_original = method
    return wrapper


def _patch_optimizers():
    # keras/src/optimizers/base_optimizer.py: `_backend_apply_gradients` calls
    # `_clip_gradients(grads)` once per real update (after gradient accumulation),
    # before `_backend_update_step`. Reducing there makes clipnorm/global_clipnorm act
    # on the averaged gradient and keeps accumulation local.
    from keras.src.optimizers import base_optimizer

    base_optimizer.BaseOptimizer._clip_gradients = _reduce_first(
        base_optimizer.BaseOptimizer._clip_gradients
    )
    # Same file: `_backend_apply_gradients(grads, trainable_variables)` runs one update
    # (clip, weight decay, update step). Reducers that act after the update (local SGD
    # averages the weights every H steps) get the variables there.
    base_optimizer.BaseOptimizer._backend_apply_gradients = _notify_after_update(
        base_optimizer.BaseOptimizer._backend_apply_gradients
    )
    # keras/src/backend/tensorflow/optimizer.py: `_backend_update_step` sums gradients
    # with `get_replica_context().all_reduce`; tfdp has already reduced them.
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    tf_optimizer.TFOptimizer._all_reduce_sum_gradients = _skip_keras_all_reduce(
        tf_optimizer.TFOptimizer._all_reduce_sum_gradients
    )
    # keras/src/optimizers/loss_scale_optimizer.py: `apply` decides from the local
    # gradients whether they are finite. Reducing first makes it one global decision
    # (a non-finite value on any rank is non-finite in the sum).
    from keras.src.optimizers import loss_scale_optimizer

    loss_scale_optimizer.LossScaleOptimizer.apply = _reduce_first(
        loss_scale_optimizer.LossScaleOptimizer.apply
    )


def _patch_step_outputs():
    # keras/src/backend/tensorflow/trainer.py: train/test/predict steps pass the
    # outputs of `strategy.run` through module-level `reduce_per_replica`. A tfdp
    # strategy has one local replica, so Keras would return local values; the strategy
    # makes them global (mean for metrics, in-order gather for predictions).
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        hook = getattr(strategy.extended, "reduce_step_outputs", None)
        if hook is None:
            return original(values, strategy, reduction)
        return hook(values, reduction)

    reduce_per_replica._tfdp_original = original
    tf_trainer.reduce_per_replica = reduce_per_replica


def _patch_callbacks():
    # keras/src/callbacks/callback_list.py: `CallbackList.__init__(callbacks,
    # add_history, add_progbar, model, **params)` is built by fit/evaluate/predict.
    # On workers other than rank 0 tfdp drops the progress bar and the callbacks that
    # only write files, and makes BackupAndRestore read-only.
    from keras.src.callbacks import callback_list
    from keras.src.callbacks.backup_and_restore import BackupAndRestore
    from keras.src.callbacks.model_checkpoint import ModelCheckpoint
    from keras.src.callbacks.tensorboard import TensorBoard

    original = callback_list.CallbackList.__init__

    @functools.wraps(original)
    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params):
        strategy = getattr(model, "_distribute_strategy", None)
        extended = getattr(strategy, "extended", None)
        extra = getattr(strategy, "training_callbacks", None)
        if extra is not None:
            callbacks = list(callbacks or []) + extra()
        if getattr(extended, "is_chief", True) is False:
            add_progbar = False
            kept = []
            for callback in callbacks or []:
                if isinstance(callback, (ModelCheckpoint, TensorBoard)):
                    continue
                if isinstance(callback, BackupAndRestore):
                    callback._save_model = lambda: None
                    callback.on_train_end = lambda logs=None: None
                kept.append(callback)
            callbacks = kept
        original(self, callbacks, add_history=add_history, add_progbar=add_progbar,
                 model=model, **params)

    __init__._tfdp_original = original
    callback_list.CallbackList.__init__ = __init__


class _FewerBatches:
    """A Keras data adapter seen through a smaller `num_batches`; everything else delegated."""

    def __init__(self, adapter, num_batches):
        self._adapter = adapter
        self._num_batches = num_batches

    @property
    def num_batches(self):
        return self._num_batches

    def __getattr__(self, name):
        return getattr(self._adapter, name)


def _patch_epoch_iterator():
    # keras/src/backend/tensorflow/trainer.py: `TFEpochIterator.__init__(distribute_strategy,
    # ...)` distributes the adapter's dataset; keras/src/trainers/epoch_iterator.py runs
    # `data_adapter.num_batches` steps per epoch. Ranks with different numbers of batches
    # would deadlock; the strategy agrees on the fewest and every rank runs that many, and
    # checks that every rank's inputs have the same shapes and dtypes.
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TFEpochIterator.__init__

    @functools.wraps(original)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        original(self, distribute_strategy, *args, **kwargs)
        extended = getattr(distribute_strategy, "extended", None)
        agree = getattr(extended, "agree_on_inputs", None)
        if agree is None:
            return
        extended.check_batch_size(getattr(self.data_adapter, "batch_size", None))
        mine = None if self.steps_per_epoch else self.data_adapter.num_batches
        fewest = agree(mine, self._distributed_dataset.element_spec)
        if not self.steps_per_epoch and fewest != mine:
            self._distributed_dataset = self._distributed_dataset.take(fewest)
            self.data_adapter = _FewerBatches(self.data_adapter, fewest)
            self._num_batches = fewest

    __init__._tfdp_original = original
    tf_trainer.TFEpochIterator.__init__ = __init__


def install():
    """Install all hooks once per process."""
    global _installed
    if _installed:
        return
    _patch_optimizers()
    _patch_step_outputs()
    _patch_callbacks()
    _patch_epoch_iterator()
    _installed = True
