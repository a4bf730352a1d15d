"""What Horovod's background loop costs in CPU while no collective runs, per cycle time.

Every `HOROVOD_CYCLE_TIME` milliseconds Horovod's background thread coordinates the ranks (an
exchange with the others), whether or not a collective is waiting. On hosts of many cores that
thread has a core of its own; on this machine the emulated hosts share 2 cores, so what it burns
is taken from the workers' compute. Each worker initialises Horovod, sleeps 3 s and prints its
process's CPU milliseconds per second of that sleep. Found with it (2 workers, stop 37): 131-180
ms/s at 1 ms (Horovod's default) and 44-75 at 4 ms, on loopback and at 100 Mbit/s alike; one
worker alone 36 and 20 ms/s (docs/results.md, the advisor in lockstep). Needs root for ``--rate-mbit``.

    .venv/bin/python benchmarks/horovod_idle_cpu.py --cycle-ms 1 4 [--rate-mbit 100] [-np 2]
"""

import argparse
import os
import sys
import time


def measure(seconds=3.0):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    hvd.allreduce(tf.constant(1.0), name="started")  # every rank is up before the clock starts
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"rank {hvd.rank()} of {hvd.size()}, cycle {os.environ.get('HOROVOD_CYCLE_TIME', '1')} ms: "
          f"idle CPU {1000 * cpu / wall:.1f} ms per second", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycle-ms", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rate-mbit", type=float, help="emulated hosts at this rate (root); loopback without")
    parser.add_argument("-np", type=int, default=2)
    args = parser.parse_args()
    from tfdp.tools.launcher import launch

    for cycle in args.cycle_ms:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_CYCLE_TIME": f"{cycle:g}"}
        result = launch([sys.executable, os.path.abspath(__file__), "--worker"], args.np, rate_mbit=args.rate_mbit,
                        timeout=120, env=env, sink=None)
        print("\n".join(line.split(":", 1)[1] for line in result.output.splitlines() if "idle CPU" in line))
        if result.returncode:
            return result.returncode
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        measure()
    else:
        sys.exit(main())
