"""`allreduce_seconds`: how long one all-reduce takes on this job's link, as the job sees it;
`timed_calls`: the seconds of repeated calls, after untimed ones that trace."""

import statistics
import time

import tensorflow as tf


def timed_calls(call, repeats, untimed=1, ready=None):
    """Seconds of each of `repeats` calls of `call`, after `untimed` ones (tracing, building);
    `ready`, if given, is called between the two.

    Example:
        >>> statistics.median(timed_calls(lambda: step().numpy(), 8))
    """
    for _ in range(untimed):
        call()
    if ready is not None:
        ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def allreduce_seconds(communicator, elements, repeats=3):
    """Median seconds of an eager all-reduce of `elements` float32 (after one untimed).

    A collective: call it on every rank. With ``elements=1`` it is the latency of one collective
    (Horovod's negotiation and one round trip); with many, the link's bandwidth shows.

    Example:
        >>> latency = allreduce_seconds(strategy.extended.communicator, 1)
    """
    value = tf.zeros([elements], tf.float32)
    return statistics.median(timed_calls(lambda: communicator.allreduce([value], op="sum")[0].numpy(), repeats))
