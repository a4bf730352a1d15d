"""The tf.distribute machinery shared by all tfdp strategies.

Each process holds one replica on its CPU (or its local device); the strategy
reports `num_replicas_in_sync` equal to the number of Horovod workers, so Keras
scales losses and splits work as it would for that many replicas, and every
cross-replica operation is a Horovod collective.
"""

import os
import sys
import zlib

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, mirrored_strategy, reduce_util
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.framework import random_seed
from tensorflow.python.ops import control_flow_util

from tfdp import _compat
from tfdp._state import local_variable
from tfdp.comm import CommunicationStats, Communicator
from tfdp.data import shard_global_batches

_SIGNATURE_DIMS = 8
VERBOSE_WORKERS_ENV = "TFDP_VERBOSE_WORKERS"


def _variable_signature(name, value):
    """Encode name, dtype and shape of an initial value as an int64 row."""
    shape = list(value.shape)
    dims = shape[:_SIGNATURE_DIMS] + [-1] * (_SIGNATURE_DIMS - len(shape))
    name_code = zlib.crc32(str(name).encode()) & 0x7FFFFFFF
    return [name_code, value.dtype.as_datatype_enum, len(shape)] + [int(d) for d in dims]


def _describe_signature(row):
    ndim = int(row[2])
    dims = [int(d) for d in row[3 : 3 + min(ndim, _SIGNATURE_DIMS)]]
    return f"dtype={tf.dtypes.as_dtype(int(row[1])).name}, shape={dims}, name-hash={int(row[0])}"


def _describe_spec(element_spec):
    """`dtype[shape without the batch axis]` of every input tensor, e.g. 'float32[4], int64[]'."""
    return ", ".join(f"{spec.dtype.name}{list(spec.shape)[1:]}" for spec in tf.nest.flatten(element_spec))


class HorovodExtended(mirrored_strategy.MirroredExtended):
    """`tf.distribute` internals of the tfdp strategies: one local replica per Horovod worker."""

    def __init__(self, container_strategy, communicator, gradient_reducer, global_step_logs=True):
        self.communicator = communicator
        self.gradient_reducer = gradient_reducer
        self.global_step_logs = global_step_logs
        self._rank = communicator.rank
        self._size = communicator.size
        super().__init__(container_strategy, devices=["/cpu:0"])

    @property
    def rank(self):
        return self._rank

    @property
    def is_chief(self):
        return self._rank == 0

    # -- replicas ---------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return self._size

    def _use_merge_call(self):
        # One local replica: every cross-replica step can run inline in replica context.
        return False

    def _call_for_each_replica(self, fn, args, kwargs):
        if self._size > 1 and control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()
        ):
            raise ValueError(
                "tfdp runs Horovod collectives, which cannot be compiled by XLA. "
                "Received a step compiled with jit_compile=True. "
                "Pass jit_compile=False to model.compile() (or to tf.function)."
            )
        # One local replica: run it inline, as TF's default strategy does. Unlike
        # MirroredStrategy's replica threads, an inline ReplicaContext can merge_call
        # from inside cond branches (LossScaleOptimizer updates variables there).
        with distribute_lib.ReplicaContext(
            self._container_strategy(), replica_id_in_sync_group=self._rank
        ):
            return fn(*args, **kwargs)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return 0

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._rank

    # -- variables ----------------------------------------------------------------
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        initial_value = kwargs["initial_value"]
        if self._size == 1:
            return initial_value
        name = kwargs.get("name")
        dtype = kwargs.get("dtype")

        def initial_value_from_rank0():
            value = initial_value() if callable(initial_value) else initial_value
            value = tf.convert_to_tensor(value, dtype=dtype)
            if tf.executing_eagerly():
                self._check_same_variable_everywhere(name, value)
            return self.communicator.broadcast(value, root_rank=0)

        return initial_value_from_rank0

    def _check_same_variable_everywhere(self, name, value):
        mine = np.array([_variable_signature(name, value)], dtype=np.int64)
        everyone = self.communicator.allgather(tf.constant(mine)).numpy()
        for rank, row in enumerate(everyone):
            if not np.array_equal(row, everyone[0]):
                raise ValueError(
                    f"tfdp: the model differs across workers. Variable {name!r} has "
                    f"{_describe_signature(everyone[0])} on rank 0 but "
                    f"{_describe_signature(row)} on rank {rank}. Build the same model, "
                    "in the same order, on every worker."
                )

    # -- collectives --------------------------------------------------------------
    @staticmethod
    def _op_name(reduce_op):
        if isinstance(reduce_op, str):
            reduce_op = reduce_util.ReduceOp(reduce_op.upper())
        return "sum" if reduce_op == reduce_util.ReduceOp.SUM else "average"

    def _local(self, value):
        if isinstance(value, tf_values.DistributedValues):
            value = value._values[0]  # The only local replica.
        return tf.convert_to_tensor(value)  # Densifies IndexedSlices too.

    def _all_reduce_structure(self, reduce_op, value):
        flat = [self._local(v) for v in tf.nest.flatten(value)]
        reduced = self.communicator.allreduce(flat, op=self._op_name(reduce_op))
        return tf.nest.pack_sequence_as(value, reduced)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        return self._all_reduce_structure(reduce_op, value)

    def _reduce_to(self, reduce_op, value, destinations, options):
        if isinstance(value, tf_values.Mirrored) and self._op_name(reduce_op) == "average":
            return self._local(value)  # Already the same on every worker.
        return self._all_reduce_structure(reduce_op, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self._all_reduce_structure(reduce_op, [v for v, _ in value_destination_pairs])

    def _gather_to_implementation(self, value, destinations, axis, options):
        local = self._local(value)
        if axis == 0:
            return self.communicator.allgather(local)
        perm = [axis] + [i for i in range(local.shape.rank) if i != axis]
        gathered = self.communicator.allgather(tf.transpose(local, perm))
        return tf.transpose(gathered, np.argsort(perm))

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def reduce_step_outputs(self, values, reduction):
        """Make Keras step outputs global: metrics averaged, predictions gathered."""
        if reduction == "concat":
            return tf.nest.map_structure(self.communicator.allgather, values)
        if reduction == "first" or not self.global_step_logs:
            return values
        op = "sum" if reduction == "sum" else "average"
        flat = tf.nest.flatten(values)
        floats = [i for i, t in enumerate(flat) if tf.as_dtype(t.dtype).is_floating]
        reduced = self.communicator.allreduce([flat[i] for i in floats], op=op)
        for i, r in zip(floats, reduced):
            flat[i] = r
        return tf.nest.pack_sequence_as(values, flat)

    # -- input --------------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        return shard_global_batches(dataset, self._rank, self._size)

    def check_batch_size(self, batch_size):
        """Raise when a global batch cannot give every worker a row (called by tfdp._compat)."""
        if batch_size is not None and batch_size < self._size:
            raise ValueError(
                f"The global batch size {batch_size} is smaller than the number of workers "
                f"({self._size}): every worker needs at least one row per batch. The batch_size "
                f"passed to fit/evaluate/predict is the global batch; use batch_size >= {self._size}.")

    def agree_on_inputs(self, count, element_spec):
        """Check the ranks' inputs match; return the fewest global batches per epoch (tfdp._compat).

        `count` is this rank's number of batches (None: unknown); `element_spec` its input
        structure. Inputs of different shapes or dtypes are an error on every rank. Without
        agreeing on the count, a rank with more batches would wait forever in an all-reduce
        the others never join. Rule: a rank with more batches drops its last ones, every
        epoch, and says so on stderr; no rows are padded.
        """
        if self._size == 1:
            return count
        spec = _describe_spec(element_spec)
        mine = -1 if count is None else int(count)
        gathered = self.communicator.allgather(
            tf.constant([[mine, zlib.crc32(spec.encode())]], tf.int64)).numpy().tolist()
        counts, fingerprints = [c for c, _ in gathered], [f for _, f in gathered]
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        if differ:
            raise ValueError(
                f"The workers' inputs differ in shape or dtype: ranks {differ} do not match rank 0 "
                f"(this is rank {self._rank}, whose inputs are {spec}). Pass inputs of the same "
                f"shapes and dtypes on every rank.")
        if len(set(counts)) == 1:
            return count
        if min(counts) < 0:
            raise ValueError(
                f"The workers' inputs differ in length and some lengths are unknown (global batches "
                f"per epoch by rank: {counts}; -1 unknown). Pass the same data on every rank (tfdp "
                f"splits each global batch), or set `steps_per_epoch`.")
        fewest = min(counts)
        if mine > fewest:
            print(f"tfdp: rank {self._rank} has {mine} global batches per epoch and rank "
                  f"{counts.index(fewest)} has {fewest}: rank {self._rank} drops its last "
                  f"{mine - fewest} every epoch so that all ranks end at the same step.", file=sys.stderr)
        return fewest

    def _distribute_datasets_from_function(self, dataset_fn, options):
        context = distribute_lib.InputContext(
            num_input_pipelines=self._size,
            input_pipeline_id=self._rank,
            num_replicas_in_sync=self._size,
        )
        return dataset_fn(context)

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(distribute_lib.ValueContext(self._rank, self._size))

    @property
    def should_checkpoint(self):
        return self.is_chief

    @property
    def should_save_summary(self):
        return self.is_chief


class HorovodStrategy(distribute_lib.Strategy):
    """Shared set-up of the tfdp strategies; subclasses choose the gradient reducer."""

    _collective_key_base = 0  # Read by MirroredExtended.__init__; tfdp uses no TF collectives.

    def __init__(self, make_reducer, global_step_logs=True, skip_nonfinite=False):
        _compat.install()
        for name, value in (("global_step_logs", global_step_logs), ("skip_nonfinite", skip_nonfinite)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
        communicator = Communicator(CommunicationStats())
        super().__init__(
            HorovodExtended(self, communicator, make_reducer(communicator), global_step_logs)
        )
        from tfdp.watchdog import timeout_from_env

        self._step_timeout_seconds = timeout_from_env()  # A bad value fails here, on every rank.
        # Read by tfdp._compat around every optimizer update; None: no check.
        self.extended.skipped_steps = (local_variable(lambda: tf.constant(0, tf.int64), "tfdp_skipped_steps")
                                       if skip_nonfinite else None)
        if communicator.size > 1:
            self._share_random_seed(communicator)
            if not self.extended.is_chief and os.environ.get(VERBOSE_WORKERS_ENV) != "1":
                # Rank 0 speaks for the job; errors still reach stderr on every rank.
                sys.stdout = open(os.devnull, "w")

    @staticmethod
    def _share_random_seed(communicator):
        # Keras shuffles `fit` inputs with TF's global seed; ranks must draw the same
        # permutation or the global batches would not partition the data.
        if random_seed.get_seed(None)[0] is not None:
            return
        seed = tf.constant([np.random.SeedSequence().entropy % (2**31)], tf.int64)
        tf.random.set_seed(int(communicator.broadcast(seed, root_rank=0).numpy()[0]))

    @property
    def rank(self):
        """This worker's Horovod rank."""
        return self.extended.rank

    @property
    def is_chief(self):
        """True on rank 0, the worker that prints and writes files."""
        return self.extended.is_chief

    def communication_stats(self):
        """Return what this worker handed to collectives since the strategy was created.

        Returns:
            dict with ``steps`` (gradient exchanges), ``collectives`` (collective
            calls), ``payload_bytes`` (bytes handed to collectives, all of them),
            ``dense_bytes`` (what the exchanged gradients are as float32),
            ``rounds`` and ``max_staleness``.
        """
        stats = self.extended.communicator.stats.as_dict()
        stats["max_staleness"] = 0
        return stats

    def training_callbacks(self):
        """Callbacks tfdp adds to every `fit`, `evaluate` and `predict` under this strategy."""
        if self.extended.communicator.size < 2:
            return []
        from tfdp.watchdog import StepWatchdog

        return [StepWatchdog(self.rank, self._step_timeout_seconds)]

    def skipped_steps(self):
        """Steps skipped on every rank because a reduced gradient was not finite (``skip_nonfinite``)."""
        counter = self.extended.skipped_steps
        return 0 if counter is None else int(counter.numpy())
