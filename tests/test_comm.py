"""The communication layer, in process: N fake ranks in threads, byte accounting, graph names."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.comm.communicator import Communicator, graph_collective_name
from tfdp.comm.fake import run_ranks


def test_fake_collectives_match_their_definitions():
    def body(comm):
        r = comm.rank
        mine = tf.constant([r + 1.0, 10.0 * r])
        total, mean, low, high = (comm.allreduce([mine], op=op)[0].numpy() for op in ("sum", "average", "min", "max"))
        gathered = comm.allgather(tf.fill([r + 1], r)).numpy()  # first dims differ by rank
        stacked = comm.allgather_stacked([tf.constant([r, r])])[0].numpy()
        root = comm.broadcast(tf.constant([r * 7]), root_rank=2).numpy()
        return total, mean, low, high, gathered, stacked, root

    results = run_ranks(3, body)
    for total, mean, low, high, gathered, stacked, root in results:
        np.testing.assert_array_equal(total, [6.0, 30.0])
        np.testing.assert_allclose(mean, [2.0, 10.0])
        np.testing.assert_array_equal(low, [1.0, 0.0])
        np.testing.assert_array_equal(high, [3.0, 20.0])
        assert gathered.tolist() == [0, 1, 1, 2, 2, 2]
        assert stacked.tolist() == [[0, 0], [1, 1], [2, 2]]
        assert root.tolist() == [14]


def test_bytes_are_counted_per_collective_and_per_dtype_group():
    def body(comm):
        comm.allreduce([tf.zeros([10]), tf.zeros([5])], op="sum", gradients=True)  # 60 bytes, 1 call
        comm.allgather_many([tf.zeros([4], tf.int32), tf.zeros([3]), tf.zeros([2], tf.int32)])  # 2 groups
        comm.broadcast(tf.zeros([2], tf.int64))
        return comm.stats.as_dict()

    stats = run_ranks(2, body)[0]
    assert stats["collectives"] == 1 + 2 + 1
    assert stats["gradient_bytes"] == 60
    assert stats["payload_bytes"] == 60 + (16 + 8 + 12) + 16


class _Echo(Communicator):
    """Two ranks that send the same tensors: graph-capable, for what a traced step records."""

    rank, size = 0, 2

    def _allreduce(self, tensors, op, name):
        return [t * 2 if op == "sum" else t for t in tensors]

    def _allgather(self, tensors):
        return [tf.concat([t, t], 0) for t in tensors]

    def _broadcast(self, tensor, root_rank):
        return tensor

    def _reduce_scatter(self, tensor):
        return tensor[: tensor.shape[0] // 2] * 2


def test_a_traced_collective_is_counted_in_one_update_of_known_size():
    # Counting is part of each step's graph: one AssignAdd per collective, of a constant when
    # the shapes are known at trace time, and the same totals when they are not.
    comm = _Echo()

    def exchange(x):
        comm.allreduce([x, tf.zeros([5])], op="sum", gradients=True)
        comm.allgather(tf.zeros([2], tf.int32))
        return x

    static = tf.function(exchange, input_signature=[tf.TensorSpec([10])])
    dynamic = tf.function(exchange, input_signature=[tf.TensorSpec([None])])
    ops = {name: [op.type for op in f.get_concrete_function().graph.get_operations()]
           for name, f in (("static", static), ("dynamic", dynamic))}
    assert ops["static"].count("AssignAddVariableOp") == 2
    assert "Size" not in ops["static"]
    assert ops["dynamic"].count("AssignAddVariableOp") == 2
    assert "Size" in ops["dynamic"]  # control: an unknown shape is measured inside the graph
    static(tf.zeros([10]))
    dynamic(tf.zeros([10]))
    stats = comm.stats.as_dict()
    assert stats["collectives"] == 4
    assert stats["gradient_bytes"] == 2 * 60
    assert stats["payload_bytes"] == 2 * (60 + 8)


def test_one_worker_sends_nothing():
    [stats] = run_ranks(1, lambda comm: (comm.allreduce([tf.ones([3])]), comm.stats.as_dict())[1])
    assert stats["collectives"] == 0 and stats["payload_bytes"] == 0


def test_an_error_on_one_rank_is_raised_not_hung():
    def body(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 failed")
        comm.allreduce([tf.ones([1])])

    with pytest.raises(ValueError, match="rank 1 failed"):
        run_ranks(2, body)


def test_graph_collectives_are_named_by_position_in_the_outermost_function():
    names = []

    @tf.function
    def inner(x):
        names.append(graph_collective_name("allreduce"))
        return x

    def other_branch(x):
        names.append(graph_collective_name("allgather"))
        return x

    @tf.function
    def outer(x):
        names.append(graph_collective_name("allreduce"))
        x = tf.cond(x[0] > 0, lambda: inner(x), lambda: other_branch(x))
        names.append(graph_collective_name("broadcast"))
        return x

    outer(tf.ones([1]))
    # The branches and the nested function count in the outer function's sequence.
    assert names == ["tfdp_allreduce_0", "tfdp_allreduce_1", "tfdp_allgather_2", "tfdp_broadcast_3"]
    # A retrace (new input signature) starts from 0 again: ranks that retrace at
    # different times still pair the same collectives.
    names.clear()
    outer(tf.ones([2]))
    assert names[0] == "tfdp_allreduce_0"
    assert graph_collective_name("allreduce") is None  # eager: Horovod orders them itself


def test_allreduce_seconds_times_the_collective_on_every_rank_and_counts_each_call():
    from tfdp.comm.timing import allreduce_seconds

    def body(comm):
        return allreduce_seconds(comm, 1, repeats=3), comm.stats.as_dict()["collectives"]

    for seconds, collectives in run_ranks(2, body):
        assert 0 < seconds < 5
        assert collectives == 4  # one untimed, then `repeats` timed


def test_allgather_stacked_sends_every_dtype_in_one_collective_and_restores_each_tensor():
    def body(comm):
        r = comm.rank
        tensors = [tf.constant([[1.5 + r, -2.0], [3.0, r]]), tf.constant([7 + r, -1], tf.int32),
                   tf.constant([-3 - r, 5, 127], tf.int8), tf.constant([40_000 + r], tf.uint16),
                   tf.constant([[255 - r]], tf.uint8)]
        return comm.allgather_stacked(tensors, gradients=True), comm.stats.as_dict(), tensors

    (gathered, stats, mine), (_, _, theirs) = run_ranks(2, body)
    assert stats["collectives"] == 1  # 5 tensors of 5 dtypes: one buffer of bytes
    assert stats["payload_bytes"] == stats["gradient_bytes"] == 16 + 8 + 3 + 2 + 1
    for got, a, b in zip(gathered, mine, theirs):
        assert got.dtype == a.dtype and got.shape == [2, *a.shape]
        np.testing.assert_array_equal(got.numpy(), np.stack([a.numpy(), b.numpy()]))


def test_allgather_stacked_in_a_traced_function_with_a_shape_known_only_at_run_time():
    echo = _Echo()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.int32)])
    def gather(values, indices):
        return echo.allgather_stacked([values, indices])

    values, indices = gather(tf.constant([0.5, -1.0, 3.0]), tf.constant([4, 0, 9], tf.int32))
    np.testing.assert_array_equal(values.numpy(), [[0.5, -1.0, 3.0]] * 2)
    np.testing.assert_array_equal(indices.numpy(), [[4, 0, 9]] * 2)
