"""Every use tfdp makes of TensorFlow's non-public modules, each naming its file."""

import contextlib
import threading

import tensorflow as tf

# tensorflow/python/distribute/mirrored_strategy.py: the `StrategyExtendedV2` of
# `tf.distribute.MirroredStrategy`. tfdp's strategies reuse its variable creation (one
# local replica) and override every cross-replica operation with Horovod collectives.
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended  # noqa: F401

# tensorflow/python/distribute/values.py: a value known to be the same on every replica.
from tensorflow.python.distribute.values import Mirrored  # noqa: F401

# Same file: a variable each replica updates on its own and a cross-replica read reduces
# (what Keras's metric variables become under a strategy).
from tensorflow.python.distribute.values import SyncOnReadVariable  # noqa: F401


def local_variable(initial_value, name):
    """Create a non-trainable variable outside any strategy's variable creator.

    tfdp's own state (counters, error-feedback residuals, PowerSGD's Q) is created lazily,
    sometimes while a Keras step is being traced under a tfdp strategy. Calling
    `ResourceVariable` directly (tensorflow/python/ops/resource_variable_ops.py) skips the
    creator stack, so the strategy neither broadcasts the value nor checks it against other
    ranks; `init_scope` lifts the creation out of the traced function. Pass
    `initial_value` as a callable when it would otherwise be computed inside a traced
    function.
    """
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope(), tf.device("/cpu:0"):
        return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


_creation = threading.local()


@contextlib.contextmanager
def variables_local_to_this_rank():
    """Within this block, variables created under a tfdp strategy keep this rank's value.

    They are neither broadcast from rank 0 nor checked against other ranks (which run
    collectives per variable), so ranks may create different numbers and shapes of them:
    the shards of a sharded optimizer state, say. Unlike `local_variable`, they are created
    by the strategy, so Keras's optimizers update them as usual.
    """
    previous = getattr(_creation, "local", False)
    _creation.local = True
    try:
        yield
    finally:
        _creation.local = previous


def creating_local_variables():
    """True inside `variables_local_to_this_rank`."""
    return getattr(_creation, "local", False)


def assign_in_update_context(pairs):
    """Assign each ``(variable, value)`` through the current strategy's `extended.update`.

    Inside a step (replica context) a plain ``variable.assign`` makes a tf.distribute
    variable reduce its new value across replicas first (`_reduce_to`: an all-reduce under
    tfdp, per variable). Values that are already the same on every worker go in through a
    merge call and `extended.update`, as Keras's TF optimizer
    (keras/src/backend/tensorflow/optimizer.py `_backend_update_step`) updates weights.
    Keras variables are unwrapped to their TF variable (`.value`).
    """

    def assign_all(strategy, pairs):
        for variable, value in pairs:
            variable = getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable
            strategy.extended.update(variable, lambda v, x: v.assign(x), args=(value,), group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(assign_all, tf.distribute.get_strategy(), list(pairs))


def global_seed():
    """TensorFlow's global random seed, or None when none was set.

    Reads tensorflow/python/eager/context.py `Context.global_seed` (eager) or the graph's
    `seed` attribute. Unlike `random_seed.get_seed`, it does not raise when op
    determinism is enabled and no seed is set.
    """
    from tensorflow.python.eager import context

    if tf.executing_eagerly():
        return context.global_seed()
    return tf.compat.v1.get_default_graph().seed


#: `dataset_order`'s answer for a pipeline whose order each process draws for itself.
ORDER_DRAWN_PER_PROCESS = -1


def list_fingerprint(items):
    """A CRC-32 of a list (0 when it is empty), to compare lists across ranks in one all-gather.

    Example:
        >>> list_fingerprint([]), list_fingerprint([(2, 1)]) == list_fingerprint([(2, 1)])
        (0, True)
    """
    import zlib

    return (zlib.crc32(repr(items).encode()) or 1) if items else 0


def _stages(dataset):
    """Every stage of a tf.data pipeline, `dataset` first: the Python dataset objects reached
    through `_inputs()` (tensorflow/python/data/ops/dataset_ops.py). A stage that does not list
    its inputs ends the walk there."""
    seen, pending = set(), [dataset]
    while pending:
        stage = pending.pop()
        if id(stage) in seen:
            continue
        seen.add(id(stage))
        yield stage
        try:
            pending.extend(stage._inputs())
        except Exception:  # noqa: BLE001
            pass


def dataset_order(dataset):
    """How `dataset` orders its elements, comparable across processes.

    0 when nothing in it draws an order (no shuffle, no random dataset, no parallel stage
    allowed to reorder); `ORDER_DRAWN_PER_PROCESS` when a stage draws one that no seed fixes
    (``shuffle`` or ``Dataset.random`` without an op seed and without a global seed, or a parallel
    ``map``/``batch`` with ``deterministic=False``); otherwise a CRC-32 of the stages' seeds, equal
    on two processes exactly when they shuffle alike.

    Reads the shuffle and random stages' ``_seed``/``_seed2`` (shuffle_op.py, random_op.py) and
    the parallel stages' ``_deterministic`` (map_op.py, batch_op.py). A stage it cannot read
    counts as drawing no order.

    Example:
        >>> dataset_order(tf.data.Dataset.range(8).shuffle(8, seed=1)) == dataset_order(
        ...     tf.data.Dataset.range(8).shuffle(8, seed=1))
        True
    """
    try:
        deterministic_by_default = dataset.options().deterministic is not False
    except Exception:  # noqa: BLE001 - not a tf.data dataset: nothing to read
        return 0
    seeds = []
    for stage in _stages(dataset):
        if hasattr(stage, "_seed") and hasattr(stage, "_seed2"):
            pair = [int(tf.get_static_value(s) or 0) for s in (stage._seed, stage._seed2)]
            if pair == [0, 0]:  # the kernel draws a random seed of its own
                return ORDER_DRAWN_PER_PROCESS
            seeds.append(pair)
        flag = getattr(stage, "_deterministic", "true")
        if flag == "false" or (flag == "default" and not deterministic_by_default):
            return ORDER_DRAWN_PER_PROCESS
    return list_fingerprint(seeds)


def dataset_shards(dataset):
    """The ``(num_shards, index)`` of `dataset`'s ``shard`` stages that split it (num_shards > 1),
    from shard_op.py's ``_num_shards`` and ``_index``: how a Horovod script splits its data per rank.

    Example:
        >>> dataset_shards(tf.data.Dataset.range(8).shard(2, 1).batch(2))
        [(2, 1)]
    """
    if not isinstance(dataset, tf.data.Dataset):
        return []
    shards = []
    for stage in _stages(dataset):
        if hasattr(stage, "_num_shards") and hasattr(stage, "_index"):
            pair = tuple(int(tf.get_static_value(t) if tf.get_static_value(t) is not None else -1)
                         for t in (stage._num_shards, stage._index))
            if pair[0] != 1:
                shards.append(pair)
    return sorted(shards)


def dataset_cache_files(dataset):
    """The files `dataset`'s ``cache(filename)`` stages will write: those whose cache is not
    complete yet (a complete one has its ``<filename>.index``; iterating then only reads it).
    Reads cache_op.py's ``_filename``; in-memory caches (``cache()``) write nothing.

    Example:
        >>> dataset_cache_files(tf.data.Dataset.range(4).cache("/tmp/never-written").batch(2))
        ['/tmp/never-written']
    """
    import os

    if not isinstance(dataset, tf.data.Dataset):
        return []
    files = set()
    for stage in _stages(dataset):
        name = getattr(stage, "_filename", None)
        name = tf.get_static_value(name) if name is not None else None
        name = name.decode() if isinstance(name, bytes) else name
        if name and not os.path.exists(f"{name}.index"):
            files.add(name)
    return sorted(files)


XLA_ERROR = ("tfdp runs Horovod collectives, which cannot be compiled by XLA. Received a step compiled with "
             "jit_compile=True. Pass jit_compile=False to tf.function (model.compile(jit_compile=True) "
             "falls back to False by itself).")


def in_xla_context():
    """True while tracing a function that XLA will compile (jit_compile=True).

    tensorflow/python/ops/control_flow_util.py `GraphOrParentsInXlaContext`.
    """
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def outermost_function_graph():
    """The graph of the outermost `tf.function` being traced, or None when executing eagerly.

    Walks `outer_graph` (tensorflow/python/framework/func_graph.py `FuncGraph`) out of
    cond/while branch graphs and nested functions, which are traced as graphs of their own.
    """
    from tensorflow.python.framework.func_graph import FuncGraph

    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(graph, FuncGraph):
        return None
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    return graph


def resource_variable_of(variable):
    """The `ResourceVariable` holding `variable`'s value on this worker, or None.

    That is `variable` itself, a Keras 3 variable's `_value` (keras/src/backend/tensorflow/core.py),
    or the one component of a mirrored variable on this worker's single device
    (tensorflow/python/distribute/values.py `DistributedVariable.values`). XLA-compiled functions
    update it in place; they cannot take the wrappers.
    """
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable

    while not isinstance(variable, ResourceVariable):
        if isinstance(getattr(variable, "values", None), tuple) and len(variable.values) == 1:
            variable = variable.values[0]
        elif getattr(variable, "_value", None) is not None and variable._value is not variable:
            variable = variable._value
        else:
            return None
    return variable


def read_handle(handle, dtype):
    """The value of the resource variable `handle` refers to (tensorflow/python/ops/gen_resource_variable_ops.py).

    A function that takes a variable's handle, not the variable, is traced once per the
    arguments it declares (a Python `shape`, say) and reused for every variable."""
    from tensorflow.python.ops import gen_resource_variable_ops

    return gen_resource_variable_ops.read_variable_op(handle, dtype)


def assign_handle(handle, value):
    """Assign `value` to the resource variable `handle` refers to (see `read_handle`)."""
    from tensorflow.python.ops import gen_resource_variable_ops

    return gen_resource_variable_ops.assign_variable_op(handle, value)
