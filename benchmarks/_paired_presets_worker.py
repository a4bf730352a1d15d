"""Benchmark worker: the digits conv net under several presets in the same two processes,
timed in alternating blocks; writes each block's median seconds per step to --out.

    (under horovodrun) python benchmarks/_paired_presets_worker.py --presets sync fp16 --out DIR
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp.tools import workloads  # noqa: E402


class StepClock(keras.callbacks.Callback):
    """The end time of every batch of the last `fit`."""

    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


class PresetTrainer:
    """The digits model under one preset's strategy; `block()` trains `repeats` passes over the
    training split in one `fit` and returns the median seconds between the ends of its steps."""

    def __init__(self, preset, batch_size, repeats):
        self.strategy = tfdp.strategy(preset)
        keras.utils.set_random_seed(0)
        with self.strategy.scope():
            self.model = workloads.build_digits_model()
        x, y, _, _ = workloads.load_digits_split(0)
        self.x, self.y = tf.concat([x] * repeats, 0).numpy(), tf.concat([y] * repeats, 0).numpy()
        self.clock = StepClock()
        self.global_batch = batch_size * self.strategy.num_replicas_in_sync
        # Two epochs untimed: tracing, and any preset's dense warm-up steps.
        self.model.fit(self.x, self.y, batch_size=self.global_batch, epochs=2, verbose=0)

    def block(self):
        self.model.fit(self.x, self.y, batch_size=self.global_batch, epochs=1, verbose=0, callbacks=[self.clock])
        ends = self.clock.ends
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", required=True)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the training split per block")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inter-op-threads", type=int, default=2, help="as `tfdp bench` runs its jobs")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    trainers = {name: PresetTrainer(name, args.batch_size, args.repeats) for name in args.presets}
    seconds = {name: [] for name in trainers}
    names = list(trainers)
    for block in range(args.blocks):
        shift = block % len(names)  # rotate the order: no preset always runs first
        for name in names[shift:] + names[:shift]:
            seconds[name].append(trainers[name].block())
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seconds, f)


if __name__ == "__main__":
    main()
