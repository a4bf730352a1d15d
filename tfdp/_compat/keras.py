"""Every hook tfdp puts into private Keras code, in one place.

Each patch names the Keras file it depends on; ``tests/test_compat.py`` counts that
Keras really calls each hook (a spy, not an attribute check). `install()` is idempotent.

The hooks ask two things of the objects they meet, both declared here rather than
discovered: a tfdp strategy's ``extended`` implements `StrategyHooks`, and a gradient
reducer implements ``reduce``, ``before_update``, ``after_update``, ``saveable``,
``supports_accumulation``, ``optimizer_state_per_rank``, ``communicator``, ``description`` and
``shards_optimizer_state`` (the protocol of
`tfdp.reducers.GradientReducer`; a reducer that shards also implements ``check_optimizer``,
``build_sharded``, ``apply_sharded``, ``model_variables``, ``save_sharded`` and ``load_sharded``).
"""

import abc
import contextlib
import copy
import functools
import threading
import warnings
import weakref

_installed = False
_state = threading.local()
_bound_reducers = weakref.WeakKeyDictionary()  # optimizer -> reducer, for DistributedOptimizer
_sharded_optimizers = weakref.WeakSet()  # optimizers whose build/apply/save a sharding reducer runs
_multi_worker_strategies = weakref.WeakSet()  # tfdp strategies of 2+ workers made in this process
REDUCER_STATE_ATTRIBUTE = "_tfdp_reducer_state"


class StrategyHooks(abc.ABC):
    """What tfdp's Keras hooks ask of a tfdp strategy's ``extended`` object."""

    #: The `GradientReducer` of the strategy's optimizers.
    gradient_reducer = None
    #: A counter variable when steps with non-finite gradients are skipped, else None.
    skipped_steps = None

    @property
    @abc.abstractmethod
    def is_chief(self):
        """True on the worker that prints and writes files."""

    @abc.abstractmethod
    def reduce_step_outputs(self, values, reduction, training=True):
        """Make a step's outputs global (`reduction` as in Keras's `reduce_per_replica`;
        `training`: a train step's, else a test or predict step's)."""

    @abc.abstractmethod
    def check_batch_size(self, batch_size):
        """Raise when a global batch cannot give every worker a row."""

    @abc.abstractmethod
    def agree_on_inputs(self, count, element_spec, has_steps_per_epoch, content=0, order=0, cache_files=()):
        """Agree across ranks on how to iterate an epoch; return ``(mode, batches)``.

        `count` is this rank's batches per epoch: an int, ``INFINITE`` or ``UNKNOWN``;
        `content` a fingerprint of in-memory inputs (0: not known); `order` how a tf.data
        pipeline orders its elements (`tfdp._compat.tensorflow.dataset_order`); `cache_files` the
        files its ``cache`` stages will write (`tfdp._compat.tensorflow.dataset_cache_files`).
        Modes: ``"as_is"`` (every rank iterates the same way), ``"fewest"`` (stop after
        `batches`) or ``"each_step"`` (agree before every step whether all ranks have data).
        """

    @abc.abstractmethod
    def all_have_data(self, has_data):
        """Given whether this rank has a next batch, return whether every rank has one."""

    @abc.abstractmethod
    def training_step(self, data):
        """A context manager around one Keras training step on this rank's `data`; it yields the
        data the step should use (the same values, possibly ordered after the strategy's own ops)."""

    @abc.abstractmethod
    def extra_callbacks(self, model, callbacks):
        """Callbacks to run before the user's in fit/evaluate/predict (on every rank)."""

    def closing_callbacks(self, model, callbacks):
        """Callbacks to run after the user's `callbacks` in fit/evaluate/predict (on every rank)."""
        return []

    def step_failed(self, error):
        """A training or test step raised `error` (a TensorFlow op error); say what is known, then it propagates."""

    def evaluation_step(self, data):
        """A context manager around one Keras test step on this rank's `data`; it yields the data
        the step should use."""
        return contextlib.nullcontext(data)

    def gradients_ready(self, grads):
        """Inside a training step: this rank's gradients exist (before any exchange); return the
        gradients the exchange should use (the same values, possibly ordered after the
        strategy's own ops)."""
        return grads

    def metrics_reset(self):
        """Keras reset the model's metrics (start of an epoch, of evaluate)."""

    def before_inference(self, model):
        """`evaluate`, `predict`, `test_on_batch` or `predict_on_batch` starts outside `fit` (on every
        rank): make the workers' models one model, if they may differ."""

    def global_loss_share(self, local, rows):
        """Inside a train or test step: the factor that turns a loss normalized by this rank's own
        `local` count (valid entries, sum of weights; float64) into one normalized by that count
        over all ranks, in the scale the strategy expects of each rank's loss (this rank holds
        `rows` rows). None where each worker's loss stays normalized by its own count (one worker;
        workers that step on their own)."""
        return None

    def reads_reduced_together(self, variables):
        """A context manager: within it, reading any of `variables` outside a step gives its global
        value from one exchange made on entry for all of them, not one exchange per read."""
        return contextlib.nullcontext()

    def rows_of_this_rank(self, global_rows):
        """How many rows of every global batch of `global_rows` rows this rank's step takes (the
        same rows of each batch), or None where that changes from batch to batch."""
        return global_rows

    def this_ranks_rows(self, batch):
        """This rank's rows of one global batch (eager tensors)."""
        return batch


INFINITE, UNKNOWN = -1, -2  # tf.data's cardinality codes


@contextlib.contextmanager
def _flag(name, value=True):
    """Within this block the thread-local flag `name` is `value`."""
    previous = getattr(_state, name, False)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def distributing_for_keras():
    """True while Keras's epoch iterator distributes its dataset: it gets whole global batches,
    and the step splits them (`step_takes_whole_batch`)."""
    return getattr(_state, "distributing_for_keras", False)


def step_takes_whole_batch():
    """True while a Keras train, test or predict function runs (or traces): its `strategy.run`
    receives a whole global batch, of which this rank takes its rows."""
    return getattr(_state, "whole_batch", False)


def one_replica_step():
    """Within this block the step runs on this rank's rows already (a nested `strategy.run` does not split)."""
    return _flag("whole_batch", False)


def _strategy_hooks(strategy):
    extended = getattr(strategy, "extended", None)
    return extended if isinstance(extended, StrategyHooks) else None


def note_multi_worker_strategy(strategy):
    """Remember that `strategy`, a tfdp strategy of 2+ workers, exists (see `_warn_if_trained_alone`)."""
    _multi_worker_strategies.add(strategy)


def _refuse_model_built_outside(model, strategy):
    """Refuse to compile, in `strategy`'s scope, a model whose layers were built outside it.

    Its weights were created before any tfdp strategy could make them rank 0's on every rank:
    on 2 workers such a model trained with averaged gradients from each rank's own random
    initial weights, and the ranks' models stayed apart, silently. (Taking it over instead,
    with rank 0's weights, fails at the first optimizer with slots: TF's MirroredStrategy only
    colocates slots with variables created in its scope, as under tf.distribute.)
    """
    if strategy.num_replicas_in_sync < 2 or not model.weights:
        return
    raise ValueError(
        f"The model {model.name!r} was built outside the scope of its tfdp strategy, so its weights differ "
        "between the workers (each drew its own initial values). Create the model inside "
        "`with strategy.scope():` and compile it there, as under tf.distribute.")


def _warn_if_trained_alone(model):
    """Once per model: a model that `fit` trains outside every tfdp strategy (built outside the
    scope, no `DistributedOptimizer`, Keras's own `train_step`) while a strategy of 2+ workers
    exists trains alone on each worker; say so, in case the scope was forgotten."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    strategies = list(_multi_worker_strategies)
    if (not strategies or getattr(model, "_tfdp_warned_alone", False) or _strategy_hooks(model.distribute_strategy)
            or bound_reducer(getattr(model, "optimizer", None)) is not None
            or type(model).train_step is not tf_trainer.TensorFlowTrainer.train_step):
        return
    model._tfdp_warned_alone = True
    workers = strategies[0].num_replicas_in_sync
    warnings.warn(f"tfdp: the model {model.name!r} was built outside every tfdp strategy's scope, so `fit` trains it "
                  f"on each of the {workers} workers alone (no gradient is exchanged, and the workers' weights "
                  "differ). If it should train across the workers, create and compile it inside "
                  "`with strategy.scope():`.", stacklevel=3)


def bind_reducer(optimizer, reducer):
    """Give `optimizer` its own reducer (`tfdp.DistributedOptimizer`) and carry its state in checkpoints."""
    if optimizer in _bound_reducers:
        raise ValueError("This optimizer is already a tfdp.DistributedOptimizer.")
    _bound_reducers[optimizer] = reducer
    attach_reducer_state(optimizer, reducer)


def optimizer_parts(optimizer):
    """`optimizer` and the optimizers that apply its updates: a LossScaleOptimizer's inner one,
    a MultiOptimizer's sub-optimizers (keras/src/optimizers/multi_optimizer.py: those it knows
    so far; one chosen by a callable is known once the MultiOptimizer is built)."""
    if optimizer is None or isinstance(optimizer, str):
        return []
    parts = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        parts.append(inner)
    parts += [sub for sub in getattr(optimizer, "_inner_optimizers", []) if sub not in parts]
    return parts


def bind_reducer_to_parts(optimizer):
    """Give the sub-optimizers of a bound MultiOptimizer its reducer: Keras's MultiOptimizer hands
    each sub-optimizer its own variables' gradients, and the sub-optimizers apply them."""
    reducer = _bound_reducers.get(optimizer)
    if reducer is None:
        return
    for part in optimizer_parts(optimizer)[1:]:
        _bound_reducers.setdefault(part, reducer)


def bound_reducer(optimizer):
    """The reducer `bind_reducer` gave `optimizer`, or None (also for no optimizer)."""
    return None if optimizer is None else _bound_reducers.get(optimizer)


def gradient_reducer(optimizer):
    """Return the reducer that manages `optimizer`'s gradients, or None.

    A `tfdp.DistributedOptimizer` carries its own; otherwise the reducer comes from the
    tfdp strategy the optimizer was created under (keras/src/backend/tensorflow/
    optimizer.py keeps it as ``_distribution_strategy``).
    """
    if optimizer in _bound_reducers:
        return _bound_reducers[optimizer]
    hooks = _strategy_hooks(getattr(optimizer, "_distribution_strategy", None))
    return None if hooks is None else hooks.gradient_reducer


def attach_reducer_state(optimizer, reducer):
    """Make Keras save `reducer`'s state with `optimizer` (and load it back).

    keras/src/saving/saving_lib.py `_save_state` / `_load_state` walk an optimizer's
    instance attributes and save every `KerasSaveable` among them under the optimizer's
    path. Plain Keras loading never asks for this attribute, so such files still load
    without tfdp.
    """
    object.__setattr__(optimizer, REDUCER_STATE_ATTRIBUTE, reducer.saveable(optimizer))
    state_carried_by_the_whole(optimizer)


def state_carried_by_the_whole(optimizer):
    """Make `optimizer`'s parts (a MultiOptimizer's sub-optimizers, a LossScaleOptimizer's inner one)
    leave their shared reducer's state to `optimizer`, which saves it once.

    Each part made under a strategy got the state at its creation. Loaded through a part, the
    per-rank optimizer state (captured from the whole optimizer's variables) was handed to the
    part's variables by position, and Keras refused the checkpoint.
    """
    if REDUCER_STATE_ATTRIBUTE not in vars(optimizer):
        return
    for part in optimizer_parts(optimizer)[1:]:
        if REDUCER_STATE_ATTRIBUTE in vars(part):
            object.__delattr__(part, REDUCER_STATE_ATTRIBUTE)


@contextlib.contextmanager
def gradients_reduced(clipped=False):
    """Within this block, optimizers apply the gradients they are given as they are
    (``clipped=True``: without Keras's clipping either; the caller clipped them)."""
    previous = getattr(_state, "reduced", False), getattr(_state, "clipped", False)
    _state.reduced, _state.clipped = True, clipped
    try:
        yield
    finally:
        _state.reduced, _state.clipped = previous


def _update_announced():
    """Within this block the reducer has heard of the update (`before_update`) already."""
    return _flag("update_announced")


def _reducer_to_apply(optimizer):
    """`optimizer`'s reducer, or None when there is none or the gradients are already reduced."""
    if getattr(_state, "reduced", False):
        return None
    return gradient_reducer(optimizer)


def _reduce(reducer, grads, variables, optimizer):
    if variables is None:
        raise RuntimeError("tfdp: gradients reached Keras's clipping outside `_backend_apply_gradients`; "
                           "this Keras version calls its hooks in an order tfdp does not know.")
    from tfdp._compat.tensorflow import XLA_ERROR, in_xla_context

    if reducer.communicator.size > 1 and in_xla_context():  # a custom step's tf.function(jit_compile=True)
        raise ValueError(XLA_ERROR)
    hooks = _strategy_hooks(getattr(optimizer, "_distribution_strategy", None))
    if hooks is not None:
        grads = hooks.gradients_ready(grads)
    return reducer.reduce(list(grads), list(variables), optimizer)


def _reduce_in_clip(method):
    """Wrap `_clip_gradients(self, grads)`: reduce grads across workers first."""

    @functools.wraps(method)
    def wrapper(self, grads):
        if getattr(_state, "clipped", False):
            return list(grads)
        reducer = _reducer_to_apply(self)
        if reducer is None:
            return method(self, grads)
        grads = _reduce(reducer, grads, getattr(_state, "variables", None), self)
        if reducer.replaces_clipping(self):
            return grads
        with gradients_reduced():
            return method(self, grads)

    wrapper._tfdp_original = method
    return wrapper


def _reduce_before_apply(method):
    """Wrap `LossScaleOptimizer.apply(self, grads, trainable_variables=None)`: reduce first."""

    @functools.wraps(method)
    def wrapper(self, grads, trainable_variables=None):
        reducer = _reducer_to_apply(self)
        if reducer is None or reducer.shards_optimizer_state:  # a sharded inner optimizer reduces its shards
            return method(self, grads, trainable_variables)
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        # The reducer hears of the update before it reduces, as without loss scaling, and
        # from the optimizer it was handed (still-scaled gradients: settle must apply them
        # through the loss scaling); the inner optimizer's update does not announce it again.
        reducer.before_update(variables, self)
        with _update_announced():
            grads = _reduce(reducer, grads, variables, self)
            if reducer.optimizer_state_per_rank:
                grads = _non_finite_anywhere_is_non_finite_everywhere(reducer.communicator, grads)
            with gradients_reduced():
                return method(self, grads, trainable_variables)

    wrapper._tfdp_original = method
    return wrapper


def _non_finite_anywhere_is_non_finite_everywhere(communicator, grads):
    """Workers that step on their own gradients: make one rank's overflow every rank's.

    A loss-scaling optimizer skips a step whose gradients are not finite. Here each rank
    decides from its own gradients, and a rank that skipped would miss the exchange the
    others run after the update; one small all-reduce makes the decision global.
    """
    import tensorflow as tf

    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    if communicator.size == 1 or not present:
        return grads
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in present])
    everywhere = communicator.allreduce([tf.reshape(tf.cast(finite, tf.float32), [1])], op="min")[0][0] > 0
    return [g if g is None else tf.where(everywhere, g, tf.constant(float("nan"), g.dtype)) for g in grads]


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
        grads = _reduce(reducer, grads, trainable_variables, optimizer)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(g)))
                            for g in grads if g is not None])

    def update():
        with gradients_reduced():
            method(optimizer, grads, trainable_variables)
        return tf.constant(True)

    def skip():
        counter.assign_add(1)
        return tf.constant(False)

    return tf.cond(finite, update, skip)


def _around_update(method):
    """Wrap `_backend_apply_gradients(self, grads, variables)`, which runs one update.

    Makes the variables known to the reduction inside `_clip_gradients`, skips non-finite
    updates when the strategy asks to, and tells the reducer before and after the update
    (under gradient accumulation, whether the call applied the accumulated gradients: Keras's
    own test, from the iteration count `apply` bumps after this method).
    """

    @functools.wraps(method)
    def wrapper(self, grads, trainable_variables):
        reducer = gradient_reducer(self)
        if reducer is not None and self.gradient_accumulation_steps and not reducer.supports_accumulation:
            raise ValueError(
                f"tfdp's {reducer.description} does not support `gradient_accumulation_steps` "
                "(it acts once per update). Use a larger batch, or tfdp.MirroredStrategy.")
        hooks = _strategy_hooks(getattr(self, "_distribution_strategy", None))
        counter = None if hooks is None else hooks.skipped_steps
        previous = getattr(_state, "variables", None)
        _state.variables = trainable_variables
        updated = None
        if reducer is not None:
            if self.gradient_accumulation_steps:
                updated = (self._iterations + 1) % self.gradient_accumulation_steps == 0
            if not getattr(_state, "update_announced", False):
                reducer.before_update(trainable_variables, self)
        try:
            if counter is not None:
                result = _update_unless_nonfinite(method, self, grads, trainable_variables, counter)
            else:
                result = method(self, grads, trainable_variables)
        finally:
            _state.variables = previous
        if reducer is not None:
            reducer.after_update(trainable_variables, updated=updated)
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


def _attach_state_on_creation(method):
    """Wrap `TFOptimizer.__init__`: an optimizer created under a tfdp strategy carries its
    reducer's state into checkpoints from the start, so `load_weights` before `fit` finds it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        method(self, *args, **kwargs)
        if getattr(_state, "plain", False):
            return
        reducer = gradient_reducer(self)
        if reducer is not None:
            _take_over(self, reducer)

    wrapper._tfdp_original = method
    return wrapper


def _take_over(optimizer, reducer):
    """Make `reducer` manage `optimizer`: its state rides in the optimizer's checkpoints, and
    the optimizer's slots are sharded where the reducer shards them."""
    attach_reducer_state(optimizer, reducer)
    if reducer.shards_optimizer_state:
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

        (_scale_losses_of_shards if isinstance(optimizer, LossScaleOptimizer) else _shard)(optimizer, reducer)


def _shard(optimizer, reducer):
    """Hand `optimizer`'s build, apply and checkpoint methods to a sharding reducer.

    keras/src/optimizers/base_optimizer.py: `apply(grads, trainable_variables)` builds the
    optimizer on first use (`self.build(variables)`, which subclasses such as Adam
    override) and `apply_gradients` calls `self.apply`; saving_lib calls
    `save_own_variables(store)` / `load_own_variables(store)`, and `fit` ends with
    `finalize_variable_values` (moving averages into the model, `use_ema`). Instance attributes take
    precedence over all of them, for this optimizer only. The reducer builds the optimizer
    on its shards (`build_recording_slots`) and calls back `apply_to(grads, shards)`.
    """
    reducer.check_optimizer(optimizer)
    cls = type(optimizer)

    def build(variables):
        import tensorflow as tf

        # An optimizer a custom train_step applies (a GAN's second one) is built on its first
        # apply, inside the traced step: the layout is read from eager values.
        with tf.init_scope():
            reducer.build_sharded(optimizer, list(variables))

    def apply(grads, trainable_variables=None):
        if trainable_variables is None:
            if not optimizer.built:
                return cls.apply(optimizer, grads, None)  # Keras's error: build first
            trainable_variables = reducer.model_variables(optimizer)
        trainable_variables = list(trainable_variables)
        if not optimizer.built:
            build(trainable_variables)

        def apply_to(shard_grads, shards):
            with gradients_reduced(clipped=True):
                cls.apply(optimizer, shard_grads, shards)

        reducer.apply_sharded(optimizer, list(grads), trainable_variables, apply_to)

    def finalize_variable_values(var_list):
        # `fit` ends with this on the model's variables; the moving averages are of the shards.
        if optimizer.use_ema and optimizer.built:
            with optimizer._distribution_strategy.scope():
                reducer.overwrite_with_averages(optimizer)

    def save_own_variables(store):
        reducer.save_sharded(optimizer, store, lambda s: cls.save_own_variables(optimizer, s))

    def load_own_variables(store):
        reducer.load_sharded(optimizer, store, lambda s: cls.load_own_variables(optimizer, s))

    for name, method in (("build", build), ("apply", apply), ("finalize_variable_values", finalize_variable_values),
                         ("save_own_variables", save_own_variables), ("load_own_variables", load_own_variables)):
        object.__setattr__(optimizer, name, method)
    _sharded_optimizers.add(optimizer)


def _scale_losses_of_shards(optimizer, reducer):
    """Make a `LossScaleOptimizer` work over a sharded inner optimizer.

    keras/src/optimizers/loss_scale_optimizer.py: `apply` asks `check_finite(grads)`, then
    in one `cond` branch divides the gradients by the scale and calls
    `inner_optimizer.apply`; `build` builds the inner optimizer; `variables` (and so
    `save_own_variables`) are its own ``_variables`` followed by the inner optimizer's.
    Here the local gradients arrive unreduced (the sharded inner optimizer reduces its
    shards), so the finiteness check becomes one decision for all workers (an all-reduce of
    one flag: a non-finite value on any rank is one in the sum), and the saved layout is its
    own variables followed by the inner optimizer's whole (sync-layout) state.
    """
    cls = type(optimizer)

    def check_finite(grads):
        return reducer.all_finite(cls.check_finite(optimizer, grads))

    def build(variables):
        inner = optimizer.inner_optimizer
        if inner not in _sharded_optimizers:  # created outside the strategy's scope
            _shard(inner, reducer)
        cls.build(optimizer, variables)

    def save_own_variables(store):
        for i, variable in enumerate(optimizer._variables):
            store[str(i)] = variable.numpy()
        optimizer.inner_optimizer.save_own_variables(_ShiftedStore(store, len(optimizer._variables)))

    def load_own_variables(store):
        own = len(optimizer._variables)
        for i, variable in enumerate(optimizer._variables):
            if str(i) in store.keys():
                variable.assign(store[str(i)])
        optimizer.inner_optimizer.load_own_variables(_ShiftedStore(store, own))

    for name, method in (("check_finite", check_finite), ("build", build),
                         ("save_own_variables", save_own_variables), ("load_own_variables", load_own_variables)):
        object.__setattr__(optimizer, name, method)


class _ShiftedStore:
    """Entries ``offset, offset + 1, ...`` of a Keras variable store, as ``0, 1, ...``."""

    def __init__(self, store, offset):
        self.store, self.offset = store, offset

    def keys(self):
        return [str(int(k) - self.offset) for k in self.store.keys() if int(k) >= self.offset]

    def __getitem__(self, key):
        return self.store[str(int(key) + self.offset)]

    def __setitem__(self, key, value):
        self.store[str(int(key) + self.offset)] = value


def build_recording_slots(optimizer, variables):
    """Build `optimizer` (its class's own `build`) on `variables`; say what each of its variables is.

    Returns one entry per ``optimizer.variables``: ``(index into variables, slot name)``
    for a slot made by `add_variable_from_reference` (every per-entry slot of Keras's
    optimizers: momentum, velocity, ...), None for anything else (iterations, learning rate,
    or state not shaped like a variable).
    """
    index_of = {id(v): i for i, v in enumerate(variables)}
    made = {}
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        slot = original(reference_variable, name=name, initializer=initializer)
        made[id(slot)] = (index_of.get(id(reference_variable)), name or "var")
        return slot

    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    try:
        type(optimizer).build(optimizer, list(variables))
    finally:
        object.__delattr__(optimizer, "add_variable_from_reference")
    return [made.get(id(v)) for v in optimizer.variables]


def built_variables(optimizer):
    """The variables `optimizer` was built for (keras/src/optimizers/base_optimizer.py
    `_trainable_variables`); empty before it is built."""
    return list(getattr(optimizer, "_trainable_variables", []) or [])


def template_optimizer(optimizer):
    """A new, unbuilt optimizer of `optimizer`'s class and config, never sharded (for layouts)."""
    previous = getattr(_state, "plain", False)
    _state.plain = True
    try:
        return type(optimizer).from_config(optimizer.get_config())
    finally:
        _state.plain = previous


def exclude_from_weight_decay_like(optimizer, pairs):
    """Exclude each new variable of `pairs` ``(model variable, new variable)`` from weight decay
    when its model variable is (keras/src/optimizers/base_optimizer.py keeps excluded
    variables' keys in `_exclude_from_weight_decay`; name patterns match names, which the
    new variables share)."""
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded:
        excluded |= {optimizer._var_key(new) for old, new in pairs if optimizer._var_key(old) in excluded}
        optimizer._exclude_from_weight_decay_cache = {}


def _patch(owner, name, wrap):
    setattr(owner, name, wrap(getattr(owner, name)))


def _patch_optimizers():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer, multi_optimizer

    # keras/src/optimizers/base_optimizer.py: `_backend_apply_gradients(grads,
    # trainable_variables)` runs one update (after gradient accumulation) and calls
    # `_clip_gradients(grads)` before `_backend_update_step`. Reducing there makes
    # clipnorm/global_clipnorm act on the reduced gradient and keeps accumulation local.
    _patch(base_optimizer.BaseOptimizer, "_clip_gradients", _reduce_in_clip)
    _patch(base_optimizer.BaseOptimizer, "_backend_apply_gradients", _around_update)
    # keras/src/backend/tensorflow/optimizer.py: `_backend_update_step` sums gradients with
    # `get_replica_context().all_reduce`; tfdp has already reduced them. Its `__init__`
    # records the strategy the optimizer was created under.
    _patch(tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _skip_keras_all_reduce)
    _patch(tf_optimizer.TFOptimizer, "__init__", _attach_state_on_creation)
    # keras/src/optimizers/loss_scale_optimizer.py: `apply` decides from the local
    # gradients whether they are finite. Reducing first makes it one global decision
    # (a non-finite value on any rank is non-finite in the sum).
    _patch(loss_scale_optimizer.LossScaleOptimizer, "apply", _reduce_before_apply)
    # keras/src/optimizers/multi_optimizer.py: `build(var_list)` asks its map (or callable) for each
    # variable's sub-optimizer and builds them; they apply the updates.
    _patch(multi_optimizer.MultiOptimizer, "build", _sub_optimizers_managed_alike)
    _patch(multi_optimizer.MultiOptimizer, "apply", _one_step_for_all_parts)


def _one_step_for_all_parts(method):
    """Wrap `MultiOptimizer.apply(self, grads, trainable_variables=None)`: its sub-optimizers'
    updates make one training step, which the reducers' statistics count once
    (`counts_a_training_step`), not once per sub-optimizer."""

    @functools.wraps(method)
    def wrapper(self, grads, trainable_variables=None):
        with _flag("parts_of_one_step"), _flag("step_counted", False):
            return method(self, grads, trainable_variables)

    wrapper._tfdp_original = method
    return wrapper


def counts_a_training_step():
    """Whether the reduction about to run starts a training step in the statistics: always, except
    for a MultiOptimizer's sub-optimizers after the first that reduces (decided while tracing)."""
    if not getattr(_state, "parts_of_one_step", False):
        return True
    if getattr(_state, "step_counted", False):
        return False
    _state.step_counted = True
    return True


def _sub_optimizers_managed_alike(method):
    """Wrap `MultiOptimizer.build(var_list)`: its sub-optimizers get its reducer (a
    `tfdp.DistributedOptimizer`) or are taken over by its strategy like it (made outside every
    scope and unused) or refused (made under another strategy), before they build anything.
    Without this a DistributedOptimizer(MultiOptimizer(...)) never averaged (the ranks' weights
    drifted apart), and a sub-optimizer made outside the scope failed in TensorFlow (mixing
    strategies) at the first step."""

    @functools.wraps(method)
    def wrapper(self, var_list):
        if not self.built:
            for sub in map(self._optimizer_map, var_list):
                if sub not in self._inner_optimizers and not isinstance(sub, type(self)):
                    sub.loss_scale_factor = self.loss_scale_factor  # as Keras's build does for a new one
                    self._inner_optimizers.append(sub)
            strategy = getattr(self, "_distribution_strategy", None)
            if self in _bound_reducers:
                bind_reducer_to_parts(self)
            elif _strategy_hooks(strategy) is not None:
                _adopt_optimizer_made_outside_any_scope(self, strategy)
                _refuse_optimizer_of_another_strategy(self, strategy)
            state_carried_by_the_whole(self)
        return method(self, var_list)

    wrapper._tfdp_original = method
    return wrapper


def _patch_compile():
    # keras/src/trainers/trainer.py `compile` creates a string optimizer, the loss and the
    # metrics under whatever strategy is current, and keras/src/backend/tensorflow/
    # optimizer.py records it in the optimizer. A model of a tfdp strategy recompiled outside
    # the scope (fine-tuning after freezing layers) gets them under its own strategy; an
    # optimizer object made outside would apply gradients tfdp never averages, so it is refused.
    from keras.src.trainers import trainer

    original = trainer.Trainer.compile

    @functools.wraps(original)
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        import tensorflow as tf

        strategy = getattr(self, "_distribute_strategy", None)
        if _strategy_hooks(strategy) is None:
            current = tf.distribute.get_strategy()
            if strategy is None and _strategy_hooks(current) is not None:
                _refuse_model_built_outside(self, current)
            return original(self, optimizer, *args, **kwargs)
        _adopt_optimizer_made_outside_any_scope(optimizer, strategy)
        _refuse_optimizer_of_another_strategy(optimizer, strategy)
        _scale_overridden_loss_once(type(self))
        if tf.distribute.has_strategy():
            return original(self, optimizer, *args, **kwargs)
        with strategy.scope():
            return original(self, optimizer, *args, **kwargs)

    compile._tfdp_original = original
    trainer.Trainer.compile = compile


def _scale_overridden_loss_once(model_class):
    """Make `model_class`'s own `compute_loss` (if it overrides Keras's) a loss for one worker's
    share of the global batch, as Keras's is.

    Under a strategy Keras divides every `keras.losses.Loss` and the regularization losses by the
    number of workers (`scale_loss_for_distribution`, keras/src/losses/loss.py), so that the
    workers' gradients sum to the global batch's. An override written as in Keras's own
    docstring, ``ops.mean((y_pred - y) ** 2) + ops.sum(self.losses)``, is not divided: on 2
    workers its gradients and its logged loss were twice one process's (tf.distribute's too).
    Within the override Keras's division is off, and its result is divided once, whatever the
    override is made of (plain ops, Loss objects, `super().compute_loss`).
    """
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import trainer

    override = model_class.compute_loss
    if override is trainer.Trainer.compute_loss or getattr(override, "_tfdp_original", None):
        return

    @functools.wraps(override)
    def compute_loss(self, *args, **kwargs):
        if getattr(_state, "loss_scaled_once", False) or _strategy_hooks(self._distribute_strategy) is None:
            return override(self, *args, **kwargs)
        with _flag("loss_scaled_once"):
            loss = override(self, *args, **kwargs)
        return None if loss is None else loss_module.scale_loss_for_distribution(loss)

    compute_loss._tfdp_original = override
    model_class.compute_loss = compute_loss


def _patch_loss_scaling():
    # keras/src/losses/loss.py: `scale_loss_for_distribution(value)` divides by the number of
    # replicas; Loss.__call__ (in that module) and the TensorFlow trainer's
    # `_aggregate_additional_loss` call it. Within an overridden compute_loss
    # (`_scale_overridden_loss_once`) it leaves the loss as it is.
    from keras.src.losses import loss as loss_module

    original = loss_module.scale_loss_for_distribution

    @functools.wraps(original)
    def scale_loss_for_distribution(value):
        return value if getattr(_state, "loss_scaled_once", False) else original(value)

    scale_loss_for_distribution._tfdp_original = original
    loss_module.scale_loss_for_distribution = scale_loss_for_distribution


def _global_share(local, values):
    """The strategy's `global_loss_share` for this rank's `local` count and the rows of `values`
    (its first axis); None outside a tfdp step (replica context)."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    hooks = _strategy_hooks(tf.distribute.get_strategy())
    if hooks is None:
        return None
    return hooks.global_loss_share(tf.cast(local, tf.float64), tf.cast(tf.shape(values)[0], tf.float64))


def _patch_masked_loss_normalization():
    # keras/src/losses/loss.py: `reduce_weighted_values` merges a loss's Keras mask into its
    # sample weights with `apply_mask`. For the reductions "sum_over_batch_size" and "mean" that
    # weighs valid entries by total / valid of the replica's own batch, and `reduce_values` divides
    # "mean_with_sample_weight" losses by the replica's own sum of weights. Each worker's loss is
    # then the mean over its own valid entries; the mean of those is not the one-process loss when
    # the ranks hold different numbers of valid entries (padded sequences, `ignore_class`).
    # tf.distribute does the same. Under a tfdp strategy whose steps run in lockstep, both are
    # normalized by the count summed across ranks (one scalar sum per masked loss and step).
    # Metrics call `apply_mask` with reduction "sum", which does not normalize: left as it is.
    import tensorflow as tf
    from keras.src.losses import loss as loss_module

    original_apply_mask = loss_module.apply_mask
    original_reduce_values = loss_module.reduce_values

    @functools.wraps(original_apply_mask)
    def apply_mask(sample_weight, mask, dtype, reduction):
        weights = original_apply_mask(sample_weight, mask, dtype, reduction)
        if mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return weights
        share = _global_share(tf.reduce_sum(tf.cast(mask, tf.float64)), mask)
        return weights if share is None else weights * tf.cast(share, weights.dtype)

    @functools.wraps(original_reduce_values)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = original_reduce_values(values, sample_weight, reduction)
        if (sample_weight is None or loss_module.standardize_reduction(reduction) != "mean_with_sample_weight"
                or loss is values):
            return loss
        share = _global_share(tf.reduce_sum(tf.cast(sample_weight, tf.float64)), values)
        return loss if share is None else loss * tf.cast(share, loss.dtype)

    apply_mask._tfdp_original = original_apply_mask
    reduce_values._tfdp_original = original_reduce_values
    loss_module.apply_mask = apply_mask
    loss_module.reduce_values = reduce_values


def _adopt_optimizer_made_outside_any_scope(optimizer, strategy):
    """Make an optimizer object created outside every strategy scope, and not built yet,
    `strategy`'s, as if created in its scope.

    Keras's transfer-learning guide unfreezes a model and compiles it again with
    ``keras.optimizers.Adam(1e-5)``, written outside any scope; tf.distribute raises there
    (mixing strategies), and tfdp refused it. The optimizer holds no slot yet: tfdp takes it
    over (keras/src/backend/tensorflow/optimizer.py records the strategy in `__init__` as
    ``_distribution_strategy``; the slots are created under it when the optimizer is built).
    Its iteration counter and learning rate stay plain variables: equal on every rank, as each
    rank creates them from the same arguments and updates them the same way.
    """
    from tensorflow.python.distribute import distribute_lib

    default = distribute_lib._get_default_strategy()
    for each in optimizer_parts(optimizer):
        if (getattr(each, "_distribution_strategy", None) is not default
                or each.built or each in _bound_reducers):
            continue
        each._distribution_strategy = strategy
        _take_over(each, gradient_reducer(each))


def _refuse_optimizer_of_another_strategy(optimizer, strategy):
    for each in optimizer_parts(optimizer):
        created_under = getattr(each, "_distribution_strategy", None)
        if created_under is not None and created_under is not strategy and each not in _bound_reducers:
            name = type(each).__name__
            raise ValueError(
                f"tfdp: the optimizer {name} was created outside the scope of the model's "
                f"{type(strategy).__name__}, so tfdp would never average its gradients across workers. "
                f"Create it inside the scope: `with model.distribute_strategy.scope(): "
                f"model.compile(optimizer=keras.optimizers.{name}(...), ...)` (a string such as "
                f"optimizer=\"adam\" also works outside the scope, and so does an optimizer object made outside "
                f"every scope that has not been used yet).")


def _patch_step_outputs():
    # keras/src/backend/tensorflow/trainer.py: train/test/predict steps pass the outputs
    # of `strategy.run` through module-level `reduce_per_replica`. A tfdp strategy has
    # one local replica, so Keras would return local values; the strategy makes them
    # global (mean for metrics, in-order gather for predictions).
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        hooks = _strategy_hooks(strategy)
        if hooks is None:
            return original(values, strategy, reduction)
        return hooks.reduce_step_outputs(values, reduction, training=getattr(_state, "step_kind", "train") == "train")

    reduce_per_replica._tfdp_original = original
    tf_trainer.reduce_per_replica = reduce_per_replica


def _spec_batch(element_spec):
    """A structure with the shape and dtype of every input, no data (OptionalSpec: None)."""
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda spec: spec if hasattr(spec, "shape") and hasattr(spec, "dtype") else None, element_spec)


def _worker_spec_batch(spec_batch, hooks):
    """`spec_batch` (of whole global batches) with the batch dimension a worker's step sees: its
    rows of a batch of known size, unknown where its rows vary from batch to batch."""
    import tensorflow as tf

    def per_worker(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank in (None, 0) or spec.shape[0] is None:
            return spec
        rows = hooks.rows_of_this_rank(int(spec.shape[0]))
        return tf.TensorSpec([rows, *spec.shape[1:]], spec.dtype, spec.name)

    return tf.nest.map_structure(per_worker, spec_batch)  # None (an optional's spec) stays None


def _fully_defined_but_batch(spec_batch):
    import tensorflow as tf

    return all(spec is None or (spec.shape.rank is not None and spec.shape[1:].is_fully_defined())
               for spec in tf.nest.flatten(spec_batch))


def _model_built(model):
    return (all(layer.built for layer in model._flatten_layers())
            and (model._compile_metrics is None or model._compile_metrics.built)
            and (model._compile_loss is None or model._compile_loss.built))


class _PrimedIterator:
    """A dataset iterator whose first element was taken to build the model; it comes first again."""

    def __init__(self, iterator, first):
        self._iterator = iterator
        self._first = [first]

    def __iter__(self):
        return self

    def __next__(self):
        return self._first.pop() if self._first else next(self._iterator)

    def get_next_as_optional(self):
        import tensorflow as tf

        if self._first:
            return tf.experimental.Optional.from_value(self._first.pop())
        return self._iterator.get_next_as_optional()


def _patch_symbolic_build():
    # keras/src/backend/tensorflow/trainer.py: under a strategy, fit/evaluate pull the
    # first batch of a fresh iterator to build the model symbolically (`_symbolic_build`),
    # then reset it. For a one-shot source (a Python generator, a PyDataset with workers)
    # the batches that iterator prefetched are lost, and how many differs by rank.
    # `_symbolic_build` only reads shapes and dtypes, so tfdp hands it the input's element
    # spec. Where the spec leaves dimensions open and the model is not built yet, one
    # real batch is taken and kept: the epoch's iterator yields it first
    # (`TFEpochIterator._get_iterator`).
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    original_get_iterator = tf_trainer.TFEpochIterator._get_iterator

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        hooks = _strategy_hooks(self._distribute_strategy)
        if (iterator is None or data_batch is not None or hooks is None
                or not isinstance(iterator, tf_trainer.TFEpochIterator)):
            return original(self, iterator=iterator, data_batch=data_batch)
        data_batch = _spec_batch(iterator._distributed_dataset.element_spec)
        if not _fully_defined_but_batch(data_batch) and not _model_built(self):
            dataset_iterator = iter(original_get_iterator(iterator))
            data_batch = next(dataset_iterator)
            iterator._tfdp_primed = _PrimedIterator(dataset_iterator, data_batch)
            data_batch = hooks.this_ranks_rows(data_batch)
        else:
            data_batch = _worker_spec_batch(data_batch, hooks)
        return original(self, iterator=None, data_batch=data_batch)

    @functools.wraps(original_get_iterator)
    def _get_iterator(self):
        primed = getattr(self, "_tfdp_primed", None)
        if primed is not None:
            self._tfdp_primed = None
            return primed
        return original_get_iterator(self)

    _maybe_symbolic_build._tfdp_original = original
    _get_iterator._tfdp_original = original_get_iterator
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.TFEpochIterator._get_iterator = _get_iterator


def checkpoint_due(callback, batch=None):
    """Whether `callback` (ModelCheckpoint or BackupAndRestore) writes at this epoch end
    (`batch` None) or at the end of training batch `batch`; ask before it runs.

    For batch frequencies it asks Keras's own `_should_save_on_batch` (keras/src/callbacks/
    model_checkpoint.py, backup_and_restore.py) on a copy, so the callback's counters move
    only when the callback itself runs.
    """
    if batch is None:
        return callback.save_freq == "epoch"
    if callback.save_freq == "epoch" or not callback.save_freq:
        return False
    return copy.copy(callback)._should_save_on_batch(batch)


def checkpoint_callbacks(callbacks):
    """The user's callbacks that write checkpoints (ModelCheckpoint, BackupAndRestore)."""
    from keras.src.callbacks.backup_and_restore import BackupAndRestore
    from keras.src.callbacks.model_checkpoint import ModelCheckpoint

    return [c for c in callbacks or [] if isinstance(c, (ModelCheckpoint, BackupAndRestore))]


#: Callback methods where user code may set `model.stop_training` before Keras checks it after a
#: batch (keras/src/backend/tensorflow/trainer.py `fit`: ``if self.stop_training: break`` after
#: `on_train_batch_end`), and the one before it checks after an epoch.
BATCH_HOOKS = ("on_epoch_begin", "on_train_batch_begin", "on_batch_begin", "on_train_batch_end", "on_batch_end")
EPOCH_HOOKS = ("on_epoch_end",)


def may_stop_training_at(callbacks, hooks):
    """The `callbacks` whose methods named in `hooks` run code from outside Keras and tfdp (a
    subclass's override, or a `LambdaCallback`'s function) that may set `model.stop_training`:
    code that could decide on its rank's own information (a clock, a file) to stop.

    Code may set it where its source file mentions ``stop_training`` (or where the source
    cannot be read). A file that never names it cannot set it, and its callbacks (progress
    bars, timers, loggers) cost no agreement.
    """

    def may_stop(callback, hook):
        method = getattr(callback, hook, None)
        function = getattr(method, "__func__", method)
        module = getattr(function, "__module__", None) or ""
        if method is None or module.split(".")[0] in ("keras", "tfdp"):
            return False
        code = getattr(function, "__code__", None)
        return _mentions_stop_training(code.co_filename if code is not None else None)

    return [c for c in callbacks or [] if any(may_stop(c, hook) for hook in hooks)]


@functools.lru_cache(maxsize=None)
def _mentions_stop_training(filename):
    try:
        with open(filename, encoding="utf-8", errors="replace") as source:
            return "stop_training" in source.read()
    except (OSError, TypeError):  # no file (an interactive session, a callable object): assume it may
        return True


def writes_on_rank_0_only(callbacks):
    """True if one of the user's `callbacks` writes files that tfdp lets rank 0 alone write
    (ModelCheckpoint, BackupAndRestore, TensorBoard, CSVLogger: see `_patch_callbacks`)."""
    from keras.src.callbacks.csv_logger import CSVLogger
    from keras.src.callbacks.tensorboard import TensorBoard

    return bool(checkpoint_callbacks(callbacks)) or any(isinstance(c, (TensorBoard, CSVLogger)) for c in callbacks or [])


def _settle_before_inference(method):
    """Wrap `test_on_batch`/`predict_on_batch`: the workers' models are made one first, as for
    `evaluate` and `predict`. (Each rank takes its rows of the global batch inside the step,
    as in `fit`; `train_on_batch` needs nothing more.)"""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        hooks = _strategy_hooks(self._distribute_strategy)
        if hooks is not None:
            hooks.before_inference(self)
        return method(self, *args, **kwargs)

    wrapper._tfdp_original = method
    return wrapper


def _patch_step_function(kind):
    # keras/src/backend/tensorflow/trainer.py: `make_train_function` / `make_test_function`
    # build the function from `self.train_step` / `self.test_step` (Keras's or the user's)
    # with `_make_function`. tfdp wraps the step in the strategy's hook (so the gradient
    # reduction and the step logs know this rank's rows), and the function so that a failed
    # collective can be explained (a lost host) before it raises.
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer

    maker, attribute = f"make_{kind}_function", f"{kind}_function"
    original = getattr(tf_trainer.TensorFlowTrainer, maker)

    @functools.wraps(original)
    def make_function(self, force=False):
        hooks = _strategy_hooks(self._distribute_strategy)
        if hooks is None and kind == "train" and (getattr(self, attribute) is None or force):
            reducer = bound_reducer(getattr(self, "optimizer", None))  # DistributedOptimizer, no strategy
            if reducer is not None:
                _without_xla(self, reducer.communicator.size, reducer.communicator.rank == 0)
            _warn_if_trained_alone(self)
        if hooks is None or (getattr(self, attribute) is not None and not force):
            return original(self, force)
        _without_xla(self, self._distribute_strategy.num_replicas_in_sync, hooks.is_chief)
        step = getattr(self, f"{kind}_step")
        around_step = hooks.training_step if kind == "train" else hooks.evaluation_step

        def hooked_step(data):
            with around_step(data) as step_data:
                return step(step_data)

        function = self._make_function(hooked_step)

        def explained_function(iterator):
            # The step is traced inside this call: its output reduction learns its kind.
            outer, _state.step_kind = getattr(_state, "step_kind", None), kind
            try:
                with _flag("whole_batch"):
                    return function(iterator)
            except tf.errors.OpError as error:
                hooks.step_failed(error)
                raise
            finally:
                _state.step_kind = outer

        setattr(self, attribute, explained_function)
        return explained_function

    make_function._tfdp_original = original
    setattr(tf_trainer.TensorFlowTrainer, maker, make_function)


XLA_FALLBACK_WARNING = ("tfdp: Horovod's collectives cannot be compiled by XLA, so this model's steps run "
                        "without it. Proceeding with `jit_compile=False`.")


def _without_xla(model, workers, is_chief):
    """Turn a model's ``jit_compile=True`` off, with a warning, when its steps hold collectives
    (`workers` > 1; the warning on the chief only).

    keras/src/trainers/trainer.py does the same for a model with a layer XLA cannot compile
    ("Model doesn't support `jit_compile=True`. Proceeding with `jit_compile=False`."), and
    its ``"auto"`` already means False under a tf.distribute strategy: a script that asks for
    XLA then trains on several workers instead of failing at its first step.
    """
    if model.jit_compile and workers > 1:
        if is_chief:  # one warning for the job
            warnings.warn(XLA_FALLBACK_WARNING, stacklevel=2)
        model.jit_compile = False


def _patch_predict_function():
    # keras/src/backend/tensorflow/trainer.py: `make_predict_function` builds
    # `predict_function(data)`, whose `strategy.run` gets each global batch (tfdp splits it).
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TensorFlowTrainer.make_predict_function

    @functools.wraps(original)
    def make_predict_function(self, force=False):
        if _strategy_hooks(self._distribute_strategy) is None or (self.predict_function is not None and not force):
            return original(self, force)
        _without_xla(self, self._distribute_strategy.num_replicas_in_sync,
                     _strategy_hooks(self._distribute_strategy).is_chief)
        original(self, force)
        function = self.predict_function

        def whole_batch_function(data):
            with _flag("whole_batch"):
                return function(data)

        self.predict_function = whole_batch_function
        return whole_batch_function

    make_predict_function._tfdp_original = original
    tf_trainer.TensorFlowTrainer.make_predict_function = make_predict_function


def _patch_reset_metrics():
    # keras/src/trainers/trainer.py: `reset_metrics` runs at the start of every epoch and
    # of evaluate; the strategy resets what it counts alongside the metrics.
    from keras.src.trainers import trainer

    original = trainer.Trainer.reset_metrics

    @functools.wraps(original)
    def reset_metrics(self):
        original(self)
        hooks = _strategy_hooks(getattr(self, "_distribute_strategy", None))
        if hooks is not None:
            hooks.metrics_reset()

    reset_metrics._tfdp_original = original
    trainer.Trainer.reset_metrics = reset_metrics


def _patch_metric_variables():
    # keras/src/trainers/trainer.py: `get_metrics_result` reads every metric's variables
    # outside a step (the end of every epoch and of evaluate). Under a tf.distribute strategy
    # they are SyncOnReadVariables, and each read is an exchange of its own; the strategy
    # reduces them together instead.
    # keras/src/backend/tensorflow/core.py: `Variable._direct_assign(value)` (every metric
    # reset) discards what the tf.Variable's `assign` returns, and a SyncOnReadVariable's
    # returns the value read back: an exchange per variable for nothing.
    import tensorflow as tf
    from keras.src.backend.tensorflow import core
    from keras.src.trainers import trainer

    from tfdp._compat.tensorflow import SyncOnReadVariable

    original_result = trainer.Trainer.get_metrics_result
    original_assign = core.Variable._direct_assign

    @functools.wraps(original_result)
    def get_metrics_result(self):
        hooks = _strategy_hooks(getattr(self, "_distribute_strategy", None))
        if hooks is None:
            return original_result(self)
        with hooks.reads_reduced_together([v.value for metric in self.metrics for v in metric.variables]):
            return original_result(self)

    @functools.wraps(original_assign)
    def _direct_assign(self, value):
        if isinstance(self._value, SyncOnReadVariable) and _strategy_hooks(self._value.distribute_strategy):
            self._value.assign(tf.cast(value, self._value.dtype), read_value=False)
        else:
            original_assign(self, value)

    get_metrics_result._tfdp_original = original_result
    _direct_assign._tfdp_original = original_assign
    trainer.Trainer.get_metrics_result = get_metrics_result
    core.Variable._direct_assign = _direct_assign


def _patch_on_batch():
    # keras/src/backend/tensorflow/trainer.py: `test_on_batch(x, y, sample_weight, return_dict)`
    # and `predict_on_batch(x)` run one step on the batch they are given, on every replica.
    from keras.src.backend.tensorflow import trainer as tf_trainer

    trainer = tf_trainer.TensorFlowTrainer
    for method in ("test_on_batch", "predict_on_batch"):
        setattr(trainer, method, _settle_before_inference(getattr(trainer, method)))


def _patch_callbacks():
    # keras/src/callbacks/callback_list.py: `CallbackList.__init__(callbacks, add_history,
    # add_progbar, model, **params)` is built by fit/evaluate/predict. tfdp's own callbacks
    # go first (on every rank). On workers other than rank 0 tfdp drops the progress bar
    # and TensorBoard, and ModelCheckpoint and BackupAndRestore keep counting batches (so
    # every rank knows when a checkpoint is due) but never write. CSVLogger writes on rank 0 only
    # too (every rank's logs are global, and two ranks wrote the same file).
    from keras.src.callbacks import callback_list
    from keras.src.callbacks.backup_and_restore import BackupAndRestore
    from keras.src.callbacks.csv_logger import CSVLogger
    from keras.src.callbacks.model_checkpoint import ModelCheckpoint
    from keras.src.callbacks.tensorboard import TensorBoard

    original = callback_list.CallbackList.__init__

    @functools.wraps(original)
    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params):
        hooks = _strategy_hooks(getattr(model, "_distribute_strategy", None))
        if hooks is not None:
            callbacks = (list(hooks.extra_callbacks(model, list(callbacks or []))) + list(callbacks or [])
                         + list(hooks.closing_callbacks(model, list(callbacks or []))))
            if not hooks.is_chief:
                add_progbar = False
                kept = []
                for callback in callbacks:
                    if isinstance(callback, (TensorBoard, CSVLogger)):
                        continue
                    if isinstance(callback, ModelCheckpoint):
                        callback._save_model = lambda *args, **kwargs: None
                    if isinstance(callback, BackupAndRestore):
                        callback._save_model = lambda: None
                        callback.on_train_end = lambda logs=None: None
                    kept.append(callback)
                callbacks = kept
        original(self, callbacks, add_history=add_history, add_progbar=add_progbar, model=model, **params)

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


#: Rows at each end of in-memory inputs that `_content_fingerprint` reads.
FINGERPRINT_ROWS = 16


def _content_fingerprint(iterator):
    """A CRC-32 of the first and last rows of in-memory inputs (NumPy arrays, tensors), or 0
    where the content cannot be read without consuming it (tf.data, generators, PyDataset).

    keras/src/trainers/data_adapters/array_data_adapter.py keeps the arrays as ``_inputs``.
    """
    import zlib

    import numpy as np
    from keras import tree

    inputs = getattr(iterator.data_adapter, "_inputs", None)
    if inputs is None:
        return 0
    crc = 0
    try:
        for array in tree.flatten(inputs):
            if array is None:
                continue
            for rows in (array[:FINGERPRINT_ROWS], array[-FINGERPRINT_ROWS:]):
                rows = np.asarray(rows)
                data = repr(rows.tolist()).encode() if rows.dtype == object else np.ascontiguousarray(rows).tobytes()
                crc = zlib.crc32(data, crc)
    except Exception:  # noqa: BLE001 - an input type without row slicing is simply not compared
        return 0
    return crc or 1


def _input_count(iterator):
    """This rank's batches per epoch: an int, INFINITE or UNKNOWN."""
    known = iterator.data_adapter.num_batches
    if known is not None:
        return int(known)
    cardinality = int(iterator._distributed_dataset.cardinality())
    return INFINITE if cardinality == INFINITE else UNKNOWN


def _patch_epoch_iterator():
    # keras/src/backend/tensorflow/trainer.py: `TFEpochIterator.__init__(distribute_strategy,
    # ...)` distributes the adapter's dataset; keras/src/trainers/epoch_iterator.py runs
    # `num_batches` steps per epoch, or until the data runs out. Ranks that run out at
    # different steps would deadlock in the next all-reduce. The strategy checks that every
    # rank's inputs have the same shapes and dtypes and agrees on how to iterate: as is,
    # up to the fewest batches, or (inputs of unknown length) step by step.
    from keras.src.backend.tensorflow import trainer as tf_trainer

    from tfdp._compat.tensorflow import dataset_cache_files, dataset_order, dataset_shards, list_fingerprint

    original_init = tf_trainer.TFEpochIterator.__init__
    original_next = tf_trainer.TFEpochIterator.__next__

    @functools.wraps(original_init)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        # The dataset stays whole: each step takes its rows (no per-fit dataset map to trace
        # and instantiate; that cost 25-45 ms of every `fit` call on the `make bench` MLP).
        hooks = _strategy_hooks(distribute_strategy)
        with _flag("distributing_for_keras"), _flag("arrays_by_reshape", hooks is not None):
            original_init(self, distribute_strategy, *args, **kwargs)
        self._tfdp_each_step = False
        if hooks is None:
            return
        hooks.check_batch_size(getattr(self.data_adapter, "batch_size", None))
        mode, fewest = hooks.agree_on_inputs(_input_count(self), self._distributed_dataset.element_spec,
                                             bool(self.steps_per_epoch), content=_content_fingerprint(self)
                                             or list_fingerprint(dataset_shards(self._distributed_dataset)),
                                             order=dataset_order(self._distributed_dataset),
                                             cache_files=dataset_cache_files(self._distributed_dataset))
        if mode == "fewest":
            self._distributed_dataset = self._distributed_dataset.take(fewest)
            self.data_adapter = _FewerBatches(self.data_adapter, fewest)
            self._num_batches = fewest
        self._tfdp_each_step = mode == "each_step"
        self._tfdp_hooks = hooks

    @functools.wraps(original_next)
    def __next__(self):
        if not self._tfdp_each_step:
            return original_next(self)
        # `_enumerate_iterator` yields (begin, end, tf.data iterator) per step. Fetch the
        # step's batches here, agree that every rank has them, and hand Keras a Python
        # iterator over them (its train function runs one step per element).
        begin, end, iterator = next(self._epoch_iterator)
        batches = []
        for _ in range(self.steps_per_execution):
            optional = iterator.get_next_as_optional()
            if not self._tfdp_hooks.all_have_data(bool(optional.has_value())):
                break
            batches.append(optional.get_value())
        if not batches:
            self._current_iterator = None  # As Keras does when data runs out: start afresh next epoch.
            raise StopIteration
        return begin, end, iter(batches)

    __init__._tfdp_original = original_init
    __next__._tfdp_original = original_next
    tf_trainer.TFEpochIterator.__init__ = __init__
    tf_trainer.TFEpochIterator.__next__ = __next__


def _patch_array_batches():
    # keras/src/trainers/data_adapters/array_data_adapter.py: `get_tf_dataset` traces three
    # functions and starts a parallel gather for every `fit`, `evaluate` and `predict` call on
    # arrays. Under a tfdp strategy, unshuffled arrays are cut into the same batches by reshape
    # (`whole_batches`); shuffled ones keep Keras's pipeline, whose permutation ranks share
    # through TF's global seed and which one process would draw alike.
    from keras import tree
    from keras.src.trainers.data_adapters import array_slicing
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    from tfdp.strategies.array_batches import whole_batches

    original = ArrayDataAdapter.get_tf_dataset

    @functools.wraps(original)
    def get_tf_dataset(self):
        if getattr(_state, "arrays_by_reshape", False) and not self._shuffle:
            inputs = array_slicing.convert_to_sliceable(self._inputs, target_backend="tensorflow")
            batches = whole_batches(tree.lists_to_tuples(inputs), self._batch_size)
            if batches is not None:
                return batches
        return original(self)

    get_tf_dataset._tfdp_original = original
    ArrayDataAdapter.get_tf_dataset = get_tf_dataset


def _patch_batch_norm_moments():
    # keras/src/layers/normalization/batch_normalization.py: `call` (training) takes
    # `mean, variance = self._moments(inputs, mask)`, moves the moving statistics towards them
    # and normalizes with them. A global batch smaller than the number of workers (a last batch
    # of 1 row on 2 workers) leaves a rank no rows: per-replica moments of nothing are NaN, and
    # they reached the moving statistics and, through `offset - mean * inv` (0 * NaN), gamma's
    # gradient on every rank. Such a rank uses its moving statistics instead: they stay as they
    # were, and its gradients are zero. (Synchronized batch norm takes global moments: unaffected.)
    import tensorflow as tf
    from keras.src.layers.normalization import batch_normalization

    from tfdp.reducers.base import rows_in_this_step

    layer = batch_normalization.BatchNormalization
    original = layer._moments

    @functools.wraps(original)
    def _moments(self, inputs, mask):
        mean, variance = original(self, inputs, mask)
        rows = rows_in_this_step()
        if rows is None or self.synchronized:
            return mean, variance
        empty = tf.equal(rows, 0)
        return (tf.where(empty, tf.cast(self.moving_mean, mean.dtype), mean),
                tf.where(empty, tf.cast(self.moving_variance, variance.dtype), variance))

    _moments._tfdp_original = original
    layer._moments = _moments


def _patch_stateful_rnn_batch():
    # keras/src/layers/rnn/rnn.py: a stateful RNN keeps one row of state per batch row, made in
    # `build` from the batch of `keras.Input(batch_size=...)`, the global batch. Each worker's step
    # takes its own rows of every global batch, the same rows each time, so each worker keeps the
    # states of its rows: training follows one process. (tf.distribute raises, "Expected batch
    # size: 32, Received batch size: 16".)
    import tensorflow as tf
    from keras.src.layers.rnn import rnn

    from tfdp._compat.tensorflow import variables_local_to_this_rank

    original = rnn.RNN.build

    @functools.wraps(original)
    def build(self, sequences_shape, initial_state_shape=None):
        if (self.stateful and self.states is None and sequences_shape and sequences_shape[0] is not None
                and tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context()):
            hooks = _strategy_hooks(tf.distribute.get_strategy())
            if hooks is not None:
                rows = hooks.rows_of_this_rank(int(sequences_shape[0]))
                if rows is None:
                    raise ValueError(
                        f"{self.name} is stateful: it keeps a state for each row of the batch, so each worker must "
                        "get the same rows of every batch, and balance=\"auto\" moves rows between the workers as "
                        "it times them. Use a strategy without balance=\"auto\" (fixed shares, balance=[...], "
                        "work) for a model with stateful=True layers.")
                sequences_shape = (rows, *sequences_shape[1:])
        return original(self, sequences_shape, initial_state_shape)

    original_create = rnn.RNN._create_state_variables

    @functools.wraps(original_create)
    def _create_state_variables(self, batch_size):
        # Each worker's own rows: neither broadcast from rank 0 nor checked against the other
        # ranks, whose shares (and so shapes) may differ (3 workers: 11, 11 and 10 of 32 rows).
        with variables_local_to_this_rank():
            return original_create(self, batch_size)

    build._tfdp_original = original
    _create_state_variables._tfdp_original = original_create
    rnn.RNN.build = build
    rnn.RNN._create_state_variables = _create_state_variables


def _patch_summed_increments():
    # keras/src/backend/common/variables.py: `Variable.assign_add(value)` is
    # `self.assign(self + value)` (and `assign_sub` alike). In a step under a strategy, a variable
    # with aggregation="sum" (a layer's own counter of rows, say) sums what every replica
    # assigns: each replica's `self + value`, so the old value was counted once per worker on
    # every step (a counter of 256 rows read 8160 on 2 workers; tf.distribute's
    # MirroredStrategy does the same). Under tfdp the increment goes to the tf.Variable's own
    # `assign_add`, which sums the replicas' increments, as one process counts them.
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.tensorflow import core

    from tfdp._compat.tensorflow import SyncOnReadVariable  # metrics' variables: local sums already

    def summed(original, sign):
        @functools.wraps(original)
        def wrapper(self, value):
            inner = getattr(self, "_value", None)
            if (self.aggregation != "sum" or in_stateless_scope() or isinstance(inner, SyncOnReadVariable)
                    or _strategy_hooks(getattr(inner, "distribute_strategy", None)) is None):
                return original(self, value)
            increment = self._convert_to_tensor(value, dtype=self._dtype)
            if increment.shape != self.shape:  # broadcasting: Keras's own path checks it
                return original(self, value)
            return inner.assign_add(tf.cast(sign * increment, inner.dtype))

        wrapper._tfdp_original = original
        return wrapper

    core.Variable.assign_add = summed(core.Variable.assign_add, 1)
    core.Variable.assign_sub = summed(core.Variable.assign_sub, -1)


def _saving_rank(model):
    """``(rank, workers)`` of the job `model` trains in through tfdp (a tfdp strategy, or a
    `DistributedOptimizer` without one), or None for a model tfdp does not train."""
    strategy = getattr(model, "_distribute_strategy", None)
    hooks = _strategy_hooks(strategy)
    if hooks is not None:
        return (0 if hooks.is_chief else 1), strategy.num_replicas_in_sync
    reducer = bound_reducer(getattr(model, "optimizer", None))
    return None if reducer is None else (reducer.communicator.rank, reducer.communicator.size)


def _written_on_rank_0(function):
    """Wrap ``function(model, filepath, ...)`` so that only rank 0 writes `filepath`; the other
    ranks write the same file into a temporary directory, deleted after."""

    @functools.wraps(function)
    def wrapper(model, filepath, *args, **kwargs):
        import os
        import tempfile

        job = _saving_rank(model)
        if job is None or job[1] == 1 or job[0] == 0:
            return function(model, filepath, *args, **kwargs)
        with tempfile.TemporaryDirectory(prefix="tfdp-save-") as folder:
            return function(model, os.path.join(folder, os.path.basename(os.fspath(filepath))), *args, **kwargs)

    wrapper._tfdp_original = function
    return wrapper


def _patch_saving():
    # keras/src/saving/saving_api.py: `save_model(model, filepath, ...)` and `save_weights(model,
    # filepath, ...)`; Model.save and Model.save_weights call them through the module, and
    # keras.saving and keras.models re-export save_model. An unchanged script saves on every
    # rank, to one path: HDF5 refused rank 1's write of `.weights.h5` (a lock error), and ranks
    # writing one `.keras` zip race. The other ranks write to a temporary directory instead
    # (Keras's advice for MultiWorkerMirroredStrategy), so every rank runs the same saving code
    # and raises the same errors (an unsettled sharded state), and no collective is needed: the
    # Horovod idiom `if rank == 0: model.save(...)` still works. keras/src/models/model.py
    # `Model.export(filepath, ...)` (a SavedModel for serving) too: two ranks exporting to one
    # directory failed in TF's MergeV2Checkpoints (1 of 15 exports here), each rank missing the
    # other's temporary variables file.
    import keras
    from keras.src.models import model as model_module
    from keras.src.saving import saving_api

    model_module.Model.export = _written_on_rank_0(model_module.Model.export)
    # `tf.saved_model.save(model, export_dir)` of a Keras model, likewise (other objects, such as
    # the archive `Model.export` writes through it, pass through unchanged). Hooked where
    # tensorflow/python/saved_model/save.py `save` calls it: importing `tensorflow.saved_model.*`
    # (Model.export does) replaces the public module, and a hook set on it.
    from tensorflow.python.saved_model import save as saved_model_save

    saved_model_save.save_and_return_nodes = _written_on_rank_0(saved_model_save.save_and_return_nodes)

    for name in ("save_model", "save_weights"):
        original = getattr(saving_api, name)
        wrapped = _written_on_rank_0(original)
        setattr(saving_api, name, wrapped)
        for public in (keras.saving, keras.models):
            if getattr(public, name, None) is original:
                setattr(public, name, wrapped)


def _patch_dataset_cache():
    # tensorflow/python/data/ops/dataset_ops.py: `DatasetV2.cache(filename="", name=None)`. Every
    # rank reads the whole data, so every rank builds the same pipeline: with a file, the ranks
    # of one host wrote one cache at once, and TF failed ("There appears to be a concurrent
    # caching iterator running"). Built while a tfdp strategy of 2+ workers exists, rank r > 0
    # caches to "<filename>.rank<r>"; rank 0 keeps the name asked for. (A pipeline built before
    # the strategy is checked when `fit` starts: `HorovodExtended._refuse_shared_cache_files`.)
    import os

    import tensorflow as tf

    original = tf.data.Dataset.cache

    @functools.wraps(original)
    def cache(self, filename="", name=None):
        strategies = list(_multi_worker_strategies)
        if strategies and isinstance(filename, (str, os.PathLike)) and os.fspath(filename):
            rank = strategies[0].rank
            if rank:
                filename = f"{os.fspath(filename)}.rank{rank}"
        return original(self, filename, name=name)

    cache._tfdp_original = original
    tf.data.Dataset.cache = cache


def install():
    """Install all hooks once per process."""
    global _installed
    if _installed:
        return
    _patch_optimizers()
    _patch_step_outputs()
    _patch_symbolic_build()
    _patch_callbacks()
    _patch_epoch_iterator()
    _patch_array_batches()
    _patch_on_batch()
    _patch_step_function("train")
    _patch_step_function("test")
    _patch_predict_function()
    _patch_reset_metrics()
    _patch_metric_variables()
    _patch_compile()
    _patch_saving()
    _patch_dataset_cache()
    _patch_batch_norm_moments()
    _patch_summed_increments()
    _patch_stateful_rnn_batch()
    _patch_loss_scaling()
    _patch_masked_loss_normalization()
    _installed = True


def hooked_functions():
    """(owner, name) of every function `install` replaces, for tests."""
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.callbacks import callback_list
    from keras.src.layers.normalization import batch_normalization
    from keras.src.layers.rnn import rnn
    from keras.src.losses import loss as loss_module
    from keras.src.models import model as model_module
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer, multi_optimizer
    from keras.src.saving import saving_api
    from keras.src.trainers import trainer
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    import tensorflow as tf
    from tensorflow.python.saved_model import save as saved_model_save

    return [
        (base_optimizer.BaseOptimizer, "_clip_gradients"),
        (base_optimizer.BaseOptimizer, "_backend_apply_gradients"),
        (tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients"),
        (tf_optimizer.TFOptimizer, "__init__"),
        (loss_scale_optimizer.LossScaleOptimizer, "apply"),
        (multi_optimizer.MultiOptimizer, "build"),
        (multi_optimizer.MultiOptimizer, "apply"),
        (tf_trainer, "reduce_per_replica"),
        (tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build"),
        (tf_trainer.TFEpochIterator, "_get_iterator"),
        (callback_list.CallbackList, "__init__"),
        (tf_trainer.TFEpochIterator, "__init__"),
        (tf_trainer.TFEpochIterator, "__next__"),
        (ArrayDataAdapter, "get_tf_dataset"),
        (tf_trainer.TensorFlowTrainer, "test_on_batch"),
        (tf_trainer.TensorFlowTrainer, "predict_on_batch"),
        (tf_trainer.TensorFlowTrainer, "make_train_function"),
        (tf_trainer.TensorFlowTrainer, "make_test_function"),
        (tf_trainer.TensorFlowTrainer, "make_predict_function"),
        (trainer.Trainer, "reset_metrics"),
        (trainer.Trainer, "get_metrics_result"),
        (core.Variable, "_direct_assign"),
        (trainer.Trainer, "compile"),
        (saving_api, "save_model"),
        (saving_api, "save_weights"),
        (model_module.Model, "export"),
        (saved_model_save, "save_and_return_nodes"),
        (tf.data.Dataset, "cache"),
        (batch_normalization.BatchNormalization, "_moments"),
        (core.Variable, "assign_add"),
        (core.Variable, "assign_sub"),
        (rnn.RNN, "build"),
        (rnn.RNN, "_create_state_variables"),
        (loss_module, "scale_loss_for_distribution"),
        (loss_module, "apply_mask"),
        (loss_module, "reduce_values"),
    ]

