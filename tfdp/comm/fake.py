"""An in-process stand-in for N workers: each rank is a thread, collectives meet at a barrier.

For unit tests of what does not need real processes (byte accounting, error feedback
across ranks, stale ordering, local-SGD averaging, data splitting). Collectives run
eagerly in NumPy; sums add the ranks in rank order.

Example:
    >>> results = run_ranks(2, lambda comm: comm.allreduce([tf.constant([comm.rank + 1.0])])[0].numpy())
    >>> [r.tolist() for r in results]
    [[3.0], [3.0]]
"""

import threading

import numpy as np
import tensorflow as tf

from tfdp.comm.communicator import Communicator

TIMEOUT_SECONDS = 60


class _Meeting:
    """Where the ranks' threads swap values: each puts its own, all read everyone's."""

    def __init__(self, size):
        self.size = size
        self._slots = [None] * size
        self._barrier = threading.Barrier(size, timeout=TIMEOUT_SECONDS)

    def swap(self, rank, value):
        self._slots[rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()  # Nobody overwrites a slot before all have read.
        return everyone


def _numpy(tensor):
    if not tf.executing_eagerly():
        raise RuntimeError("FakeCommunicator runs eagerly only; call the reducer outside tf.function.")
    return np.asarray(tensor)


class FakeCommunicator(Communicator):
    """Rank `rank` of an in-process group; build a group with `fake_group(size)`."""

    single_host = True  # threads of one process (a test may set False to take the network's paths)

    def __init__(self, meeting, rank, stats=None, background=None):
        self._meeting = meeting
        self._background = background or meeting
        self._rank = rank
        super().__init__(stats)

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._meeting.size

    def _allreduce(self, tensors, op, name):
        everyone = self._meeting.swap(self._rank, [_numpy(t) for t in tensors])
        results = []
        for i, t in enumerate(tensors):
            values = [ranks[i] for ranks in everyone]
            if op in ("sum", "average"):
                total = values[0].copy()
                for v in values[1:]:
                    total = total + v
                value = total / self.size if op == "average" else total
            else:
                value = (np.minimum if op == "min" else np.maximum).reduce(np.stack(values))
            results.append(tf.constant(np.asarray(value, dtype=values[0].dtype), dtype=t.dtype))
        return results

    def _background_sum(self, tensor):
        # Background collectives pair among themselves, as with Horovod.
        everyone = self._background.swap(self._rank, _numpy(tensor))
        total = everyone[0].copy()
        for value in everyone[1:]:
            total = total + value
        return tf.constant(total, dtype=tensor.dtype)

    def _allgather(self, tensors):
        everyone = self._meeting.swap(self._rank, [_numpy(t) for t in tensors])
        return [tf.constant(np.concatenate([ranks[i] for ranks in everyone]), dtype=t.dtype)
                for i, t in enumerate(tensors)]

    def _reduce_scatter(self, tensor):
        everyone = self._meeting.swap(self._rank, _numpy(tensor))
        total = everyone[0].copy()
        for value in everyone[1:]:
            total = total + value
        block = total.shape[0] // self.size
        return tf.constant(total[self._rank * block:(self._rank + 1) * block], dtype=tensor.dtype)

    def _broadcast(self, tensor, root_rank):
        everyone = self._meeting.swap(self._rank, _numpy(tensor))
        return tf.constant(everyone[root_rank], dtype=tensor.dtype)


def fake_group(size):
    """Return `size` `FakeCommunicator`s that talk to each other (one per rank)."""
    meeting, background = _Meeting(size), _Meeting(size)
    return [FakeCommunicator(meeting, rank, background=background) for rank in range(size)]


def run_ranks(size, fn):
    """Run ``fn(communicator)`` on `size` fake ranks in threads; return their results in rank order.

    An exception on any rank is raised here (the first one, by rank).
    """
    communicators = fake_group(size)
    results, errors = [None] * size, [None] * size

    def target(rank):
        try:
            results[rank] = fn(communicators[rank])
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the caller's thread.
            errors[rank] = err
            communicators[rank]._meeting._barrier.abort()
            communicators[rank]._background._barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_SECONDS * 2)
    for err in errors:
        if err is not None and not isinstance(err, threading.BrokenBarrierError):
            raise err
    for err in errors:
        if err is not None:
            raise err
    return results
