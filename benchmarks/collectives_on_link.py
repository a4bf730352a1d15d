"""Time Horovod's collectives alone on emulated hosts: where a step's communication time goes.

Each worker runs every collective 8 times on a 4 MB float32 vector (1 M entries, an MLP's
gradient) inside a `tf.function`; rank 0 prints the median and the fastest. Found with it
(2 hosts at 100 Mbit/s): an all-gather of 2 MB per worker took 317 ms, twice the 167-176 ms of
a reduce-scatter or of an all-to-all moving the same bytes; reduce-scatter then all-gather (what
zero1 runs) 486 ms against 335 ms for sync's all-reduce. Swapping zero1's all-gather for an
all-to-all did not speed up its training step (0.67x sync, tried and reverted), so the cost is
not that collective alone (docs/results.md, optimizer-state sharding). With ``--sizes-mb`` it
times an all-gather and an all-reduce of each size per worker against its ring wire time: the
all-gather's ratio grows with its size (1.05 at 0.1 MB, 1.63 at 0.5, 2.02 at 4 MB at 100 Mbit/s),
the advisor's `allgather_slowdown`. Needs root.

    .venv/bin/python benchmarks/collectives_on_link.py [--rate-mbit 100] [-np 2]
    .venv/bin/python benchmarks/collectives_on_link.py --sizes-mb 0.1 0.25 0.5 1 2 4
"""

import argparse
import os
import statistics
import sys

ENTRIES = 1_000_000


def measure():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tfdp.comm.timing import timed_calls

    hvd.init()
    size = hvd.size()
    vector = tf.random.uniform([size * (ENTRIES // size)])
    shard = vector[: ENTRIES // size]
    cases = {
        "allreduce (sync)": lambda: hvd.allreduce(vector, op=hvd.Sum, name="ar"),
        "reducescatter": lambda: hvd.reducescatter(tf.reshape(vector, [size, -1]), op=hvd.Sum, name="rs"),
        "allgather": lambda: hvd.allgather(shard, name="ag"),
        "alltoall as allgather": lambda: hvd.alltoall(tf.tile(shard, [size]), name="a2a"),
        "reducescatter + allgather (zero1)": lambda: hvd.allgather(
            tf.reshape(hvd.reducescatter(tf.reshape(vector, [size, -1]), op=hvd.Sum, name="rs2"), [-1]), name="ag2"),
    }
    for name, body in cases.items():
        seconds = timed_calls(tf.function(body), 8)
        if hvd.rank() == 0:
            median, fastest = 1000 * statistics.median(seconds), 1000 * min(seconds)
            print(f"{name:36s} median {median:7.1f} ms   fastest {fastest:7.1f} ms", flush=True)


def measure_sizes(rate_mbit, sizes_mb):
    """All-gather (of uint8, as `Communicator.allgather_stacked` packs payloads) and all-reduce
    (float32) of each size per worker, each over its ring wire time at `rate_mbit`."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tfdp.comm.timing import timed_calls

    hvd.init()
    size, rate = hvd.size(), rate_mbit * 1e6 / 8
    for mb in sizes_mb:
        count = int(mb * 1e6)
        packed = tf.zeros([count], tf.uint8)
        floats = tf.zeros([count // 4], tf.float32)
        cases = {"allgather": (lambda: hvd.allgather(packed, name=f"ag{mb}"), (size - 1) * count / rate),
                 "allreduce": (lambda: hvd.allreduce(floats, op=hvd.Sum, name=f"ar{mb}"),
                               2 * (size - 1) / size * count / rate)}
        for name, (body, wire) in cases.items():
            seconds = timed_calls(tf.function(body), 8)
            if hvd.rank() == 0:
                median = statistics.median(seconds)
                print(f"{name} {mb:g} MB per worker: median {1000 * median:7.1f} ms, ring wire time "
                      f"{1000 * wire:6.1f} ms, ratio {median / wire:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate-mbit", type=float, default=100)
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--sizes-mb", type=float, nargs="*",
                        help="instead: all-gather and all-reduce of these sizes per worker, each over its wire time")
    args = parser.parse_args()
    from tfdp.tools.launcher import launch

    worker = [sys.executable, os.path.abspath(__file__), "--worker"]
    if args.sizes_mb:
        worker += ["--rate-mbit", str(args.rate_mbit), "--sizes-mb", *map(str, args.sizes_mb)]
    result = launch(worker, args.np, rate_mbit=args.rate_mbit,
                    timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, sink=None)
    print(f"{args.np} emulated hosts at {args.rate_mbit:g} Mbit/s"
          + ("" if args.sizes_mb else f", {4 * ENTRIES / 1e6:.0f} MB of float32") + ":")
    print("\n".join(line.split(":", 1)[1] for line in result.output.splitlines() if "median" in line))
    return result.returncode


if __name__ == "__main__":
    if "--worker" in sys.argv and "--sizes-mb" in sys.argv:
        at = sys.argv.index("--sizes-mb")
        measure_sizes(float(sys.argv[sys.argv.index("--rate-mbit") + 1]), [float(x) for x in sys.argv[at + 1:]])
    elif "--worker" in sys.argv:
        measure()
    else:
        sys.exit(main())
