"""`HorovodExtended`: the `tf.distribute` internals shared by all tfdp strategies.

Each process holds one replica on its CPU (or its local device); the strategy reports
`num_replicas_in_sync` equal to the number of Horovod workers, so Keras scales losses and
splits work as it would for that many replicas, and every cross-replica operation is a
collective of the strategy's `Communicator`. It also implements `tfdp._compat.keras.
StrategyHooks`, what tfdp's Keras hooks ask of a strategy.
"""

import contextlib
import sys
import zlib

import numpy as np
import tensorflow as tf

from tfdp._compat.horovod import cross_rank
from tfdp._compat.keras import (UNKNOWN, StrategyHooks, distributing_for_keras, one_replica_step,
                                step_takes_whole_batch)
from tfdp._compat.tensorflow import (Mirrored, MirroredExtended, SyncOnReadVariable, creating_local_variables,
                                     ORDER_DRAWN_PER_PROCESS, XLA_ERROR, dataset_cache_files, dataset_order,
                                     dataset_shards, in_xla_context, list_fingerprint, local_variable)
from tfdp.reducers.base import rows_in_this_step, rows_of_this_step
from tfdp.runtime import replica_device
from tfdp.strategies.data import num_rows, shard_global_batches, share_of_rank, take_rows

_SIGNATURE_DIMS = 8


def _variable_signature(value):
    """dtype, rank and shape of an initial value as an int64 row (names are not compared)."""
    shape = list(value.shape)
    dims = shape[:_SIGNATURE_DIMS] + [-1] * (_SIGNATURE_DIMS - len(shape))
    return [value.dtype.as_datatype_enum, len(shape)] + [int(d) for d in dims]


def _describe_signature(row):
    ndim = int(row[1])
    dims = [int(d) for d in row[2 : 2 + min(ndim, _SIGNATURE_DIMS)]]
    return f"dtype={tf.dtypes.as_dtype(int(row[0])).name}, shape={dims}"


def _describe_spec(element_spec):
    """`dtype[shape without the batch axis]` of every input, e.g. 'float32[4], int64[]'."""
    parts = []
    for spec in tf.nest.flatten(element_spec):
        dtype = getattr(spec, "dtype", None)
        shape = getattr(spec, "shape", None)
        kind = {"SparseTensorSpec": "sparse ", "RaggedTensorSpec": "ragged "}.get(type(spec).__name__, "")
        parts.append("none" if dtype is None else f"{kind}{dtype.name}{list(shape)[1:]}")
    return ", ".join(parts)


class _ReplicaContext(tf.distribute.ReplicaContext):
    """The replica context of a tfdp step: in-step sums (synchronized batch norm) whose backward
    pass matches the reducer's weighting of each rank's gradient by its rows."""

    def all_reduce(self, reduce_op, value, options=None):
        extended = self._strategy.extended
        rows = rows_in_this_step()
        flat = tf.nest.flatten(value)
        if (rows is None or extended._size == 1 or extended._op_name(reduce_op) != "sum"
                or not extended.gradient_reducer.weights_rows
                or any(isinstance(v, tf.IndexedSlices) for v in flat)):
            return super().all_reduce(reduce_op, value, options)
        return tf.nest.pack_sequence_as(value, extended._sum_with_rows_weighted_backward(flat, rows))


class HorovodExtended(MirroredExtended, StrategyHooks):
    """`tf.distribute` internals of the tfdp strategies: one local replica per worker."""

    def __init__(self, container_strategy, communicator, gradient_reducer, global_step_logs=True, balancer=None):
        self.communicator = communicator
        self.gradient_reducer = gradient_reducer
        self.global_step_logs = global_step_logs
        self.balancer = balancer
        self.skipped_steps = None
        self._rank = communicator.rank
        self._size = communicator.size
        # Orders each step's output reduction after the previous step's (see reduce_step_outputs).
        self._outputs_fence = local_variable(tf.constant(0, tf.int64), "tfdp_step_outputs_fence")
        # This rank's rows since Keras last reset its metrics: step logs are running means over them.
        self._rows_since_reset = (balancer.epoch_rows if balancer is not None else
                                  local_variable(tf.constant(0, tf.int64), "tfdp_rows_since_metrics_reset"))
        # id -> (SyncOnReadVariable, its global value) inside `reads_reduced_together`.
        self._reduced_reads = {}
        super().__init__(container_strategy, devices=[replica_device()])

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
        if self._size > 1 and in_xla_context():
            raise ValueError(XLA_ERROR)
        # One local replica: run it inline, as TF's default strategy does. Unlike
        # MirroredStrategy's replica threads, an inline ReplicaContext can merge_call
        # from inside cond branches (LossScaleOptimizer updates variables there).
        if step_takes_whole_batch() and args and self._size > 1:  # Keras's step: this rank's rows
            args = (take_rows(args[0], self._rank, self._size, self.balancer), *args[1:])
        with _ReplicaContext(self._container_strategy(), replica_id_in_sync_group=self._rank), one_replica_step():
            return fn(*args, **kwargs)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return 0

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._rank

    # -- variables ----------------------------------------------------------------
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        initial_value = kwargs["initial_value"]
        if self._size == 1 or creating_local_variables():
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
        """Variables are matched by creation order, shape and dtype, as Horovod and tf.distribute do.

        Names are not compared (Keras's automatic names differ when one rank built another
        model first); they appear only in the error, once shapes or dtypes differ.
        """
        mine = np.array([_variable_signature(value)], dtype=np.int64)
        everyone = self.communicator.allgather(tf.constant(mine)).numpy()
        differ = [rank for rank, row in enumerate(everyone) if not np.array_equal(row, everyone[0])]
        if not differ:
            return
        names = self._gather_strings(str(name))
        rank = differ[0]
        raise ValueError(
            f"tfdp: the model differs across workers. The variable created in this position is "
            f"{names[0]!r} with {_describe_signature(everyone[0])} on rank 0 but {names[rank]!r} with "
            f"{_describe_signature(everyone[rank])} on rank {rank}. Build the same model, in the same "
            "order, on every worker.")

    def _gather_strings(self, text):
        data = np.frombuffer(text.encode(), np.uint8)
        lengths = self.communicator.allgather(tf.constant([len(data)], tf.int64)).numpy()
        joined = bytes(self.communicator.allgather(tf.constant(data, tf.uint8)).numpy())
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return [joined[offsets[i]:offsets[i + 1]].decode() for i in range(len(lengths))]

    # -- collectives --------------------------------------------------------------
    @staticmethod
    def _op_name(reduce_op):
        if isinstance(reduce_op, str):
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
        return "sum" if reduce_op == tf.distribute.ReduceOp.SUM else "average"

    def _local(self, value):
        if isinstance(value, tf.distribute.DistributedValues):
            value = self._container_strategy().experimental_local_results(value)[0]  # The only replica.
        return tf.convert_to_tensor(value)  # Densifies IndexedSlices too.

    def _all_reduce_structure(self, reduce_op, value):
        flat = [self._local(v) for v in tf.nest.flatten(value)]
        reduced = self.communicator.allreduce(flat, op=self._op_name(reduce_op))
        return tf.nest.pack_sequence_as(value, reduced)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        rows = rows_in_this_step()
        if rows is not None and self._op_name(reduce_op) == "average" and self._size > 1:
            # A mean across workers inside a training step (what a variable with aggregation="mean"
            # gets when a layer assigns it: a running mean of its inputs, say): each worker's value
            # weighted by its rows, as one process takes the mean over the whole batch. Equal
            # shares give the plain average.
            flat = [self._local(v) for v in tf.nest.flatten(value)]
            return tf.nest.pack_sequence_as(value, self._rows_weighted_average(flat, rows, self._in_step_allreduce))
        return self._all_reduce_structure(reduce_op, value)

    def _sum_with_rows_weighted_backward(self, tensors, rows):
        """A sum across ranks (synchronized batch norm's statistics) whose backward pass weights
        each rank's upstream gradient by its rows: the gradient reducer weights rank r's
        gradient by its rows r, so the part of it that flows back from rank s's loss through
        the sum must arrive scaled by rows s / rows r. Equal rows: the plain sum's backward."""
        allreduce = self._in_step_allreduce

        @tf.custom_gradient
        def summed(*values):
            def backward(*upstream):
                weight = tf.cast(rows, tf.float32)
                sums = allreduce([u * tf.cast(weight, u.dtype) for u in upstream])
                return [tf.math.divide_no_nan(s, tf.cast(weight, s.dtype)) for s in sums]

            return allreduce(list(values)), backward

        return summed(*tensors)

    def _in_step_allreduce(self, tensors):
        """A sum inside a training step; under ``balance="auto"`` the time it waits for slower
        ranks is not counted as this rank's compute."""
        balancer = self.balancer
        if balancer is None or not balancer.auto:
            return self.communicator.allreduce(tensors, op="sum")
        with tf.control_dependencies(tensors):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            tensors = [tf.identity(t) for t in tensors]
        summed = self.communicator.allreduce(tensors, op="sum")
        with tf.control_dependencies(summed):
            end = tf.timestamp()
        balancer.waited(end - start)
        with tf.control_dependencies([end]):  # read the clock as soon as the sum arrives
            return [tf.identity(s) for s in summed]

    def global_loss_share(self, local, rows):
        # Rank r's loss, normalized by its own count c_r, becomes S_r / C (C: the count over all
        # ranks) times what the exchange undoes: P where gradients are summed as they are, N / n_r
        # where the exchange weights rank r by its rows n_r of N (and so do the step logs; a test
        # step's loss is logged weighted by rows). Summed, either gives the one-process loss's
        # gradient, for any split of the batch.
        if self._size == 1 or not self.gradient_reducer.lockstep:
            return None
        counts = tf.stop_gradient(tf.stack([local, rows]))
        training = rows_in_this_step() is not None
        # No compute time to keep apart from waiting in a test step.
        total, all_rows = tf.unstack(self._in_step_allreduce([counts])[0] if training
                                     else self.communicator.allreduce([counts], op="sum")[0])
        if training and not self.gradient_reducer.weights_rows:
            return tf.math.divide_no_nan(local * float(self._size), total)
        return tf.math.divide_no_nan(local * all_rows, total * rows)

    def _reduce_to(self, reduce_op, value, destinations, options):
        variable, reduced = self._reduced_reads.get(id(value), (None, None))
        if variable is value:
            return reduced
        if isinstance(value, Mirrored) and self._op_name(reduce_op) == "average":
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

    def _gather_rows(self, value):
        """Every rank's rows of a step output, in rank order (dense, ragged or sparse)."""
        if isinstance(value, tf.RaggedTensor):
            lengths = [self.communicator.allgather(r) for r in value.nested_row_lengths()]
            return tf.RaggedTensor.from_nested_row_lengths(self.communicator.allgather(value.flat_values), lengths)
        if isinstance(value, tf.SparseTensor):
            rows = self.communicator.allgather(value.dense_shape[:1])
            offset = tf.reduce_sum(rows[: self._rank])
            indices = value.indices + tf.pad([offset], [[0, tf.size(value.dense_shape) - 1]])
            shape = tf.concat([[tf.reduce_sum(rows)], value.dense_shape[1:]], 0)
            return tf.SparseTensor(self.communicator.allgather(indices), self.communicator.allgather(value.values),
                                   shape)
        if tf.is_tensor(value):
            return self.communicator.allgather(value)
        return value

    # -- StrategyHooks ------------------------------------------------------------
    def reduce_step_outputs(self, values, reduction, training=True):
        """Make Keras step outputs global: predictions gathered in order, numbers averaged.

        ``global_step_logs=False`` leaves a training step's outputs this rank's; test steps
        are always global (an evaluation holds no worker back, and `evaluate` returns them).

        Tensors are reduced across ranks (floats averaged or summed, integers summed and,
        for a mean, divided with truncation as `tf.reduce_mean` does); Python numbers and
        NumPy values are the same on every rank and pass through, as Keras passes them.
        """
        if self._size == 1:
            return values
        if reduction == "concat":
            return tf.nest.map_structure(self._gather_rows, values)
        if reduction == "first" or (training and not self.global_step_logs):
            return values
        op = "sum" if reduction == "sum" else "average"
        # A metric's `result()` may return its variable itself (a Keras variable: its dtype is a string).
        flat = [tf.convert_to_tensor(t) if tf.is_tensor(t) else t for t in tf.nest.flatten(values)]
        floats = [i for i, t in enumerate(flat) if tf.is_tensor(t) and t.dtype.is_floating]
        ints = [i for i, t in enumerate(flat) if tf.is_tensor(t) and t.dtype.is_integer]
        # With steps_per_execution > 1 Keras runs steps in a tf.while_loop. Nothing orders
        # one step's output all-reduce after the previous step's (the gradient exchange is
        # ordered by the variable updates), and Horovod refuses a collective whose name is
        # still in flight. Reading the fence before and bumping it after chains them.
        with tf.control_dependencies([self._outputs_fence.read_value()]):
            if op == "average" and floats:
                reduced = self._rows_weighted_average([flat[i] for i in floats], self._rows_since_reset.read_value())
            else:
                reduced = self.communicator.allreduce([tf.identity(flat[i]) for i in floats], op=op)
            summed = self.communicator.allreduce([tf.identity(flat[i]) for i in ints], op="sum")
        with tf.control_dependencies(reduced + summed):
            self._outputs_fence.assign_add(1)
        for i, r in zip(floats, reduced):
            flat[i] = r
        for i, r in zip(ints, summed):
            flat[i] = tf.truncatediv(r, tf.cast(self._size, r.dtype)) if op == "average" else r
        return tf.nest.pack_sequence_as(values, flat)

    def _rows_weighted_average(self, means, rows, summed=None):
        """Each rank's `means` weighted by its `rows`: the global means when the ranks' rows differ
        (a global batch that does not split evenly, `balance`), the plain average when they do
        not. `summed` sums a list of tensors across ranks (default: one all-reduce)."""
        summed = summed or (lambda tensors: self.communicator.allreduce(tensors, op="sum"))
        weight = tf.cast(rows, tf.float32)
        *sums, total = summed([tf.cast(m, tf.float32) * weight for m in means] + [weight])
        return [tf.cast(tf.math.divide_no_nan(s, total), m.dtype) for s, m in zip(sums, means)]

    @contextlib.contextmanager
    def reads_reduced_together(self, variables):
        on_read = [v for v in variables if isinstance(v, SyncOnReadVariable)
                   and v.aggregation != tf.VariableAggregation.ONLY_FIRST_REPLICA]
        if self._size == 1 or len(on_read) < 2 or not tf.executing_eagerly():
            yield
            return
        groups = {}  # Horovod groups only tensors of one dtype.
        for variable in on_read:
            op = "sum" if variable.aggregation == tf.VariableAggregation.SUM else "average"
            groups.setdefault((op, variable.dtype), []).append(variable)
        reduced = {}
        for (op, _), group in groups.items():
            for variable, value in zip(group, self.communicator.allreduce([self._local(v) for v in group], op=op)):
                reduced[id(variable)] = (variable, value)
        previous, self._reduced_reads = self._reduced_reads, reduced
        try:
            yield
        finally:
            self._reduced_reads = previous

    def rows_of_this_rank(self, global_rows):
        if self.balancer is not None and self.balancer.auto:
            return None
        start, stop = share_of_rank(global_rows, self._rank, self._size, self.balancer)
        return int(stop - start)

    def this_ranks_rows(self, batch):
        return take_rows(batch, self._rank, self._size, self.balancer)

    def check_batch_size(self, batch_size):
        if batch_size is not None and batch_size < self._size:
            raise ValueError(
                f"The global batch size {batch_size} is smaller than the number of workers "
                f"({self._size}): every worker needs at least one row per batch. The batch_size "
                f"passed to fit/evaluate/predict is the global batch; use batch_size >= {self._size}.")

    def agree_on_inputs(self, count, element_spec, has_steps_per_epoch, content=0, order=0, cache_files=()):
        """Check the ranks' inputs match; choose how every rank iterates the epoch.

        Inputs of different shapes or dtypes are an error on every rank; in-memory inputs
        whose rows differ (`content`, a fingerprint) a warning, once; so are tf.data pipelines
        that order their elements differently (`order`, `tfdp._compat.tensorflow.dataset_order`).
        Ranks on one host whose pipelines would write the same cache files (`cache_files`) are an
        error on every rank. Equal, known
        lengths (or endless inputs) need nothing. Known lengths that differ: every rank
        stops after the fewest batches, every epoch, and the ranks with more say so on
        stderr (no rows are padded). Otherwise (a length is unknown: generators, or
        `steps_per_epoch` over inputs of different lengths) the ranks agree before every
        step whether all of them have a batch.
        """
        if self._size == 1:
            return "as_is", None
        spec = _describe_spec(element_spec)
        gathered = self.communicator.allgather(
            tf.constant([[int(count), zlib.crc32(spec.encode()), int(content), int(order),
                          list_fingerprint(sorted(cache_files)), cross_rank()]],
                        tf.int64)).numpy().tolist()
        counts, fingerprints, contents, orders, caches, hosts = ([row[i] for row in gathered] for i in range(6))
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        if differ:
            raise ValueError(
                f"The workers' inputs differ in shape or dtype: ranks {differ} do not match rank 0 "
                f"(this is rank {self._rank}, whose inputs are {spec}). Pass inputs of the same "
                f"shapes and dtypes on every rank.")
        self._refuse_shared_cache_files(caches, hosts, cache_files)
        self._warn_if_inputs_differ(contents)
        self._warn_if_order_differs(orders)
        if len(set(counts)) == 1 and counts[0] != UNKNOWN:
            return "as_is", None
        if min(counts) >= 0 and not has_steps_per_epoch:
            fewest = min(counts)
            if count > fewest:
                print(f"tfdp: rank {self._rank} has {count} global batches per epoch and rank "
                      f"{counts.index(fewest)} has {fewest}: rank {self._rank} drops its last "
                      f"{count - fewest} every epoch so that all ranks end at the same step.", file=sys.stderr)
            return "fewest", fewest
        return "each_step", None

    def _warn_if_inputs_differ(self, contents):
        """Once per strategy: NumPy inputs whose rows differ between ranks, or tf.data pipelines that
        take other shards, are almost always data already split per rank (Horovod's habit), which
        tfdp splits again."""
        if 0 in contents or len(set(contents)) == 1 or getattr(self, "_warned_inputs_differ", False):
            return
        self._warned_inputs_differ = True
        differ = [r for r, c in enumerate(contents) if c != contents[0]]
        print(f"tfdp: warning: the inputs of ranks {differ} hold other rows than rank 0's (this is rank "
              f"{self._rank}). tfdp expects the same, whole data on every rank: batch_size is the global "
              f"batch, and each rank trains on its rows of it. Data already split per rank (x[rank::size] or "
              f"Dataset.shard(size, rank), Horovod style) is split again, and each rank trains on "
              f"1/{self._size} of its share. Pass the whole data on every rank.", file=sys.stderr)

    def _refuse_shared_cache_files(self, caches, hosts, cache_files):
        """Ranks of one host whose pipelines write the same `Dataset.cache` files would collide
        (TF: "There appears to be a concurrent caching iterator running"), and the cache left behind
        would be half written: refuse before the first step, on every rank."""
        shared = sorted({r for r, (c, h) in enumerate(zip(caches, hosts))
                         if c and sum(1 for c2, h2 in zip(caches, hosts) if (c2, h2) == (c, h)) > 1})
        if not shared:
            return
        files = ", ".join(repr(f) for f in cache_files) or "the same files"
        raise ValueError(
            f"The tf.data pipelines of ranks {shared} cache to one file on the same host ({files}; this is rank "
            f"{self._rank}): they would write it at the same time, and TF fails with 'concurrent caching "
            "iterator'. Build the dataset after creating the strategy (tfdp then gives each rank its own cache "
            "file), or pass a file per rank, `.cache(f\"{path}.rank{tfdp.rank()}\")`, or cache in memory "
            "(`.cache()`).")

    def _warn_if_order_differs(self, orders):
        """Once per strategy and kind: a tf.data pipeline whose order a rank draws for itself (a
        shuffle without a seed, built before the strategy shared one) or whose seeds differ
        between ranks gives each rank other global batches, and the ranks' rows of them do not
        partition the data."""
        if ORDER_DRAWN_PER_PROCESS in orders:
            kind = "drawn"
            ranks = [r for r, o in enumerate(orders) if o == ORDER_DRAWN_PER_PROCESS]
            cause = ("shuffles without a seed, built before the strategy shared TF's global seed (or a "
                     "parallel map reorders: deterministic=False)")
        elif len(set(orders)) > 1:
            kind = "differ"
            ranks = [r for r, o in enumerate(orders) if o != orders[0]]
            cause = ("shuffles with other seeds than rank 0's (keras.utils.*_dataset_from_* draw one from "
                     "NumPy when seed=None)")
        else:
            return
        warned = self.__dict__.setdefault("_warned_orders", set())
        if kind in warned:
            return
        warned.add(kind)
        print(f"tfdp: warning: the tf.data pipeline of ranks {ranks} {cause} (this is rank {self._rank}). The "
              "ranks read different global batches, so each epoch some rows train twice and others not at all. "
              "Pass the same seed on every rank (shuffle(..., seed=...), or seed=... to the Keras utility), or "
              "build the dataset after creating the strategy.", file=sys.stderr)

    def all_have_data(self, has_data):
        flags = self.communicator.allgather(tf.constant([int(has_data)], tf.int32)).numpy().tolist()
        everyone = all(flags)
        if has_data and not everyone:
            empty = [r for r, f in enumerate(flags) if not f]
            print(f"tfdp: ranks {empty} ran out of input before rank {self._rank}: every rank ends the "
                  f"epoch here, and rank {self._rank} leaves its remaining batches unread.", file=sys.stderr)
        return everyone

    @contextlib.contextmanager
    def training_step(self, data):
        rows = _rows_of(data)
        data = self._step_started(data, rows)
        with rows_of_this_step(rows, even_likely=self.balancer is None):
            yield data

    def evaluation_step(self, data):
        return contextlib.nullcontext(self._step_started(data, _rows_of(data), timed=False))

    def _step_started(self, data, rows, timed=True):
        """Count this rank's rows for the step logs (the balancer counts them itself)."""
        if self.balancer is not None:
            return self.balancer.step_started(data, rows, timed=timed)
        self._rows_since_reset.assign_add(tf.cast(rows, tf.int64))
        return data

    def gradients_ready(self, grads):
        if self.balancer is None:
            return grads
        return self.balancer.gradients_ready(grads)

    def metrics_reset(self):
        self._rows_since_reset.assign(0)

    def extra_callbacks(self, model, callbacks):
        return self._container_strategy().training_callbacks(model, callbacks)

    def closing_callbacks(self, model, callbacks):
        return self._container_strategy().closing_callbacks(model, callbacks)

    def step_failed(self, error):
        self._container_strategy().step_failed(error)

    def before_inference(self, model):
        self._container_strategy().settle_before_inference(model)

    # -- input --------------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        if distributing_for_keras():
            return dataset  # Keras's steps take their rows (`_call_for_each_replica`)
        self._check_pipeline(dataset)
        return shard_global_batches(dataset, self._rank, self._size, self.balancer)

    def _check_pipeline(self, dataset):
        """A custom loop's dataset: the checks `agree_on_inputs` makes for Keras's (shared cache
        files, shards per rank, orders that differ between ranks), in one all-gather."""
        if self._size == 1:
            return
        files = dataset_cache_files(dataset)
        row = [dataset_order(dataset), list_fingerprint(dataset_shards(dataset)), list_fingerprint(files), cross_rank()]
        gathered = self.communicator.allgather(tf.constant([row], tf.int64)).numpy().tolist()
        orders, shards, caches, hosts = ([r[i] for r in gathered] for i in range(4))
        self._refuse_shared_cache_files(caches, hosts, files)
        self._warn_if_inputs_differ(shards)
        self._warn_if_order_differs(orders)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        context = tf.distribute.InputContext(
            num_input_pipelines=self._size, input_pipeline_id=self._rank, num_replicas_in_sync=self._size)
        return dataset_fn(context)

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(tf.distribute.experimental.ValueContext(self._rank, self._size))

    @property
    def should_checkpoint(self):
        return self.is_chief

    @property
    def should_save_summary(self):
        return self.is_chief


def _rows_of(data):
    return num_rows(next(t for t in tf.nest.flatten(data) if t is not None))
