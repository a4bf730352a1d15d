"""`Communicator`: the collectives tfdp uses, counted; `HorovodCommunicator` runs them on Horovod.

Everything tfdp exchanges between workers goes through a `Communicator`, so
`communication_stats()` is a count of real calls, not an estimate. Subclasses implement
four primitives (`_allreduce`, `_allgather`, `_broadcast`, `_reduce_scatter`); the base class does the
counting, the single-worker shortcut and the grouping by dtype.
"""

import abc
import weakref

import tensorflow as tf

from tfdp._compat.tensorflow import outermost_function_graph
from tfdp.comm.stats import CommunicationStats, total_bytes

_OPS = ("sum", "average", "min", "max")


class Communicator(abc.ABC):
    """Collectives across all workers, counted in a `CommunicationStats`.

    With one worker every collective is the identity and nothing is counted.

    Example:
        >>> comm = HorovodCommunicator()
        >>> [total] = comm.allreduce([tf.ones([3])], op="sum")
    """

    def __init__(self, stats=None):
        self.stats = stats if stats is not None else CommunicationStats()

    @property
    @abc.abstractmethod
    def rank(self):
        """This worker's rank."""

    @property
    @abc.abstractmethod
    def size(self):
        """The number of workers."""

    #: Every worker runs on this host: collectives move memory, not network bytes.
    single_host = False

    @abc.abstractmethod
    def _allreduce(self, tensors, op, name):
        """Reduce each tensor across workers (`op` in sum/average/min/max)."""

    @abc.abstractmethod
    def _allgather(self, tensors):
        """Concatenate each tensor (all of one dtype) across workers along axis 0."""

    @abc.abstractmethod
    def _broadcast(self, tensor, root_rank):
        """Root's tensor on every worker."""

    @abc.abstractmethod
    def _reduce_scatter(self, tensor):
        """Sum `tensor` across workers; return this worker's block of its axis 0 (size blocks)."""

    def _count(self, tensors, gradients=False):
        if not tensors:
            return
        total = total_bytes(tensors)
        self.stats.add_many(collectives=1, payload_bytes=total, gradient_bytes=total if gradients else 0)

    def allreduce(self, tensors, op="sum", gradients=False, name=None):
        """Reduce a list of tensors across workers in one fused collective.

        ``gradients=True`` also counts the bytes as gradient traffic. `name` names the
        collective inside a traced function (default: its position there).
        """
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}. Received: op={op!r}")
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return tensors
        self._count(tensors, gradients)
        return list(self._allreduce(tensors, op, name))

    def allreduce_in_background(self, tensor, gradients=False):
        """Sum one tensor across workers from a background thread (eagerly), counted.

        Workers pair these by their order among background calls, which must come from one
        thread at a time.
        """
        if self.size == 1:
            return tensor
        self._count([tensor], gradients)
        return self._background_sum(tensor)

    def _background_sum(self, tensor):
        return self._allreduce([tensor], "sum", None)[0]

    def allgather_many(self, tensors, gradients=False):
        """Concatenate each tensor across workers along axis 0, in rank order.

        One grouped collective per dtype (Horovod groups only tensors of one dtype).
        The first dimension may differ across workers.
        """
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return tensors
        gathered = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            chosen = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            group = [tensors[i] for i in chosen]
            self._count(group, gradients)
            for i, result in zip(chosen, self._allgather(group)):
                gathered[i] = result
        return gathered

    def allgather_stacked(self, tensors, gradients=False):
        """Gather each tensor from every worker into a new leading axis of workers, in one collective.

        Each tensor must have the same shape and dtype on every worker. Whatever their dtypes,
        the tensors travel as the bytes of one buffer (`_gather_rows`): a codec's values and
        indices, say, take one collective, not one per dtype.
        """
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return [t[None] for t in tensors]
        self._count(tensors, gradients)
        rows = self._gather_rows(tf.concat([_bytes_of(t) for t in tensors], 0))
        gathered, start = [], 0
        for t in tensors:
            # A dynamic shape (top-k's k during its warm-up) is known only when the graph runs.
            count = t.shape.num_elements() if t.shape.is_fully_defined() else tf.size(t)
            width = count * t.dtype.size
            shape = [self.size, *t.shape] if t.shape.is_fully_defined() else tf.concat([[self.size], tf.shape(t)], 0)
            gathered.append(_of_bytes(rows[:, start:start + width], t.dtype, shape))
            start += width
        return gathered

    def _gather_rows(self, buffer):
        """Every worker's 1-D uint8 `buffer` (the same length on all) as the rows of a matrix, in rank order."""
        return self._allgather([buffer[None]])[0]

    def allgather(self, tensor):
        """Concatenate `tensor` from every worker along axis 0, in rank order."""
        return self.allgather_many([tensor])[0]

    def reduce_scatter(self, tensor, gradients=False):
        """Sum `tensor` across workers and return this worker's rows of the sum.

        Axis 0 of `tensor` must be a multiple of the number of workers; worker r receives the
        r-th of `size` equal blocks of rows. Counted as the bytes of the whole `tensor` (what an
        all-reduce of it would count), though each link carries about (size - 1) / size of it.
        """
        if tensor.shape[0] is None or tensor.shape[0] % self.size:
            raise ValueError(f"reduce_scatter needs axis 0 a multiple of {self.size} workers. "
                             f"Received shape {tensor.shape}.")
        if self.size == 1:
            return tensor
        self._count([tensor], gradients)
        return self._reduce_scatter(tensor)

    def broadcast(self, tensor, root_rank=0):
        """Return root's `tensor` on every worker."""
        if self.size == 1:
            return tensor
        self._count([tensor])
        return self._broadcast(tensor, root_rank)


def _bytes_of(tensor):
    """The bytes of `tensor` as a 1-D uint8 tensor."""
    flat = tf.reshape(tensor, [-1])
    return flat if tensor.dtype == tf.uint8 else tf.reshape(tf.bitcast(flat, tf.uint8), [-1])


def _of_bytes(rows, dtype, shape):
    """Inverse of `_bytes_of`, row by row: the [workers, n bytes] uint8 `rows` as `dtype` of `shape`
    (its first axis the workers)."""
    if dtype != tf.uint8:
        if dtype.size > 1:
            rows = tf.reshape(rows, [shape[0], -1, dtype.size])
        rows = tf.bitcast(rows, dtype)
    return tf.reshape(rows, shape)


_collectives_per_graph = weakref.WeakKeyDictionary()
def graph_collective_name(kind):
    """A name for a collective traced into a `tf.function`, the same on every rank.

    Horovod pairs graph-mode collectives across workers by name, and by default derives it
    from the input tensors' names, which carry Keras's automatic layer names: those differ
    across ranks when one rank built another model first, and the job would hang. Named by
    their position in the outermost traced function instead, collectives pair by creation
    order, as tf.distribute's do; a rank that retraces a function creates them in the same
    order again. None when executing eagerly (Horovod orders eager collectives itself).
    """
    graph = outermost_function_graph()
    if graph is None:
        return None
    index = _collectives_per_graph.get(graph, 0)
    _collectives_per_graph[graph] = index + 1
    return f"tfdp_{kind}_{index}"


class HorovodCommunicator(Communicator):
    """`Communicator` over Horovod's collectives (Gloo or MPI on CPU)."""

    def __init__(self, stats=None):
        from tfdp._compat.horovod import horovod

        self._hvd = horovod()
        super().__init__(stats)

    @property
    def rank(self):
        return self._hvd.rank()

    @property
    def size(self):
        return self._hvd.size()

    @property
    def single_host(self):
        return self._hvd.local_size() == self._hvd.size()

    def _allreduce(self, tensors, op, name):
        hvd_op = {"sum": self._hvd.Sum, "average": self._hvd.Average, "min": self._hvd.Min,
                  "max": self._hvd.Max}[op]
        # ignore_name_scope: the scope (the optimizer's name, say) differs across ranks too.
        name = name or graph_collective_name("allreduce")
        if len(tensors) == 1:
            return [self._hvd.allreduce(tensors[0], op=hvd_op, name=name, ignore_name_scope=True)]
        return self._hvd.grouped_allreduce(tensors, op=hvd_op, name=name, ignore_name_scope=True)

    def _background_sum(self, tensor):
        # Eager Horovod ops of one kind share a cached TF kernel, so the name passed is
        # ignored and a background all-reduce would be paired with whatever all-reduce the
        # training thread has in flight (measured: a scalar met a gradient vector). A
        # one-tensor grouped all-reduce is a kind the training thread never issues
        # (`_allreduce` sends single tensors with `allreduce`).
        return self._hvd.grouped_allreduce([tensor], op=self._hvd.Sum)[0]

    def _allgather(self, tensors):
        name = graph_collective_name("allgather")
        if len(tensors) == 1:
            return [self._hvd.allgather(tensors[0], name=name, ignore_name_scope=True)]
        return self._hvd.grouped_allgather(tensors, name=name, ignore_name_scope=True)

    def _reduce_scatter(self, tensor):
        # Gloo's reduce-scatter (halving-doubling): each worker sends about (size-1)/size of it.
        return self._hvd.reducescatter(tensor, op=self._hvd.Sum, name=graph_collective_name("reducescatter"),
                                       ignore_name_scope=True)

    def _broadcast(self, tensor, root_rank):
        return self._hvd.broadcast(tensor, root_rank, name=graph_collective_name("broadcast"),
                                   ignore_name_scope=True)
