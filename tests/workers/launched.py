"""A worker for tests of `tfdp.tools.launcher` (TensorFlow only where Horovod needs it).

    --case ok        every rank all-reduces its rank with Horovod's Gloo ops and prints the sum
    --case fail      rank 1 exits 3 after rendezvous; rank 0 waits in an all-reduce
    --case hang      every rank sleeps forever (for timeouts and Ctrl-C)
"""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["ok", "fail", "hang"], required=True)
args = parser.parse_args()
print(f"pid {os.getpid()} rank {os.environ['HOROVOD_RANK']} iface {os.environ['HOROVOD_GLOO_IFACE']} "
      f"cpus {sorted(os.sched_getaffinity(0))}", flush=True)
if args.case == "hang":
    time.sleep(3600)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

hvd.init()
if args.case == "fail" and hvd.rank() == 1:
    os._exit(3)  # At once: no atexit shutdown of Horovod that could let rank 0 fail first.
total = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum, name="rank_sum")
print(f"sum {float(np.asarray(total)[0]):g} size {hvd.size()}", flush=True)
