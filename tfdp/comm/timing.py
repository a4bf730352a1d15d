"""`allreduce_seconds`: how long one all-reduce takes on this job's link, as the job sees it."""

import statistics
import time

import tensorflow as tf


def allreduce_seconds(communicator, elements, repeats=3):
    """Median seconds of an eager all-reduce of `elements` float32 (after one untimed).

    A collective: call it on every rank. With ``elements=1`` it is the latency of one collective
    (Horovod's negotiation and one round trip); with many, the link's bandwidth shows.

    Example:
        >>> latency = allreduce_seconds(strategy.extended.communicator, 1)
    """
    value = tf.zeros([elements], tf.float32)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        communicator.allreduce([value], op="sum")[0].numpy()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])
