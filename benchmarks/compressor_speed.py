"""Each compressor's compute per step and per MB of gradient, on the tensors of a real model.

One process, one TensorFlow thread (as each `tfdp bench` worker runs), no communication:
a codec's `exchange` on a one-worker communicator compresses every gradient and
decompresses it, which is the compute a worker adds to its step. The tensors are the
gradients' shapes of the `tfdp bench` MLP (`--params`, default 6 M: 1024-h-h-10). Top-k
runs twice in the same process: with the sampled threshold (`largest_magnitudes`) and with
`tf.math.top_k` over every entry, which it replaced. Medians of `--repeats` timed calls.

    .venv/bin/python benchmarks/compressor_speed.py [--params 6e6] [--repeats 7]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # before tfdp's import starts TensorFlow
tf.config.threading.set_inter_op_parallelism_threads(1)

from tfdp.comm.fake import fake_group  # noqa: E402
from tfdp.compression import codecs, resolve  # noqa: E402
from tfdp.reducers import ReducerState  # noqa: E402
from tfdp.tools.workloads import build_mlp  # noqa: E402

CODECS = {
    "fp16": {"name": "fp16"},
    "bf16": {"name": "bf16"},
    "qsgd": {"name": "qsgd"},
    "randomk 1%": {"name": "randomk", "ratio": 0.01},
    "topk 1% (sampled threshold)": {"name": "topk", "ratio": 0.01},
    "topk 1% (top_k over all)": {"name": "topk", "ratio": 0.01},
    "efsign": {"name": "efsign"},
    "powersgd r4": {"name": "powersgd", "rank": 4},
}


def timed(function, repeats):
    function()  # trace
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = build_mlp(args.params)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.standard_t(3, size=v.shape).astype("float32") * 1e-3) for v in model.trainable_variables]
    keys = [v.path for v in model.trainable_variables]
    megabytes = sum(int(np.prod(g.shape)) for g in grads) * 4 / 1e6
    communicator = fake_group(1)[0]
    state = ReducerState(communicator)
    rows = []
    for label, spec in CODECS.items():
        codec = resolve(spec)
        exact = "over all" in label
        step = tf.Variable(10, dtype=tf.int64)

        @tf.function
        def exchange():
            summed, _ = codec.exchange(grads, keys, step, communicator, state)
            return [tf.reduce_sum(s) for s in summed]

        previous = codecs.SAMPLED_TOP_K_MIN_ENTRIES
        codecs.SAMPLED_TOP_K_MIN_ENTRIES = 1 << 62 if exact else previous
        try:
            seconds = timed(exchange, args.repeats)
        finally:
            codecs.SAMPLED_TOP_K_MIN_ENTRIES = previous
        rows.append((label, seconds * 1000, seconds * 1000 / megabytes))
    print(f"MLP of {sum(int(np.prod(g.shape)) for g in grads):,} parameters ({megabytes:.1f} MB of float32 "
          f"gradients), one thread, median of {args.repeats}\n")
    print("| compressor | ms per step (compress + decompress) | ms per MB |")
    print("|---|---|---|")
    for label, ms, per_mb in rows:
        print(f"| {label} | {ms:.1f} | {per_mb:.2f} |")
    sampled = next(ms for label, ms, _ in rows if "sampled" in label)
    exact = next(ms for label, ms, _ in rows if "over all" in label)
    print(f"\ntop-k with the sampled threshold: {exact / sampled:.2f}x faster than top_k over all entries")


if __name__ == "__main__":
    main()
