"""Benchmark worker: one workload under several presets in the same worker processes, timed in
alternating blocks; writes each block's median seconds per step to --out (and auto's pick).

    (under horovodrun) python benchmarks/_paired_presets_worker.py --presets sync fp16 --out DIR
    (emulated hosts)   ... --workload cnn --batch-size 64 --steps 20 --presets sync topk-1pct auto --out DIR
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp.tools import workloads  # noqa: E402
from tfdp.tools.bench_worker import build_synthetic, settling_steps  # noqa: E402


class StepClock(keras.callbacks.Callback):
    """The end time of every batch of the last `fit`."""

    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def _digits(repeats):
    """The digits conv net (Adam) and the training split repeated `repeats` times."""
    x, y, _, _ = workloads.load_digits_split(0)
    return workloads.build_digits_model, np.concatenate([x] * repeats), np.concatenate([y] * repeats)


def _synthetic(workload, params, rows):
    """A builder of `tfdp bench`'s synthetic `workload` (SGD, as there) and `rows` random rows."""
    def build():
        return build_synthetic(workload, params)

    x, y = workloads.synthetic_data(build(), rows)
    return build, x, y


class PresetTrainer:
    """One preset's model; `block()` runs one `fit` over the block's data and returns the median
    seconds between the ends of its steps."""

    def __init__(self, preset, build, x, y, batch_size, warmup_blocks):
        self.strategy = tfdp.strategy(preset)
        keras.utils.set_random_seed(0)
        with self.strategy.scope():
            self.model = build()
        self.x, self.y = x, y
        self.clock = StepClock()
        self.global_batch = batch_size * self.strategy.num_replicas_in_sync
        # Untimed: tracing, any preset's dense warm-up steps, auto's measuring and its pick's warm-up.
        steps_per_block = -(-len(x) // self.global_batch)
        settling_blocks = -(-(settling_steps(self.strategy, preset) + 2) // steps_per_block)
        self.model.fit(self.x, self.y, batch_size=self.global_batch, epochs=max(warmup_blocks, settling_blocks),
                       verbose=0)

    def block(self):
        self.model.fit(self.x, self.y, batch_size=self.global_batch, epochs=1, verbose=0,
                       callbacks=[self.clock])
        ends = self.clock.ends
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))

    def picked(self):
        """What auto picked (None for the other presets)."""
        stats = getattr(self.strategy, "auto_stats", lambda: None)()
        return stats and stats["picked"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", required=True)
    parser.add_argument("--workload", choices=["digits", "cnn", "mlp"], default="digits")
    parser.add_argument("--params", type=float, default=6e6, help="the MLP's parameters")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="digits: passes over the training split per block")
    parser.add_argument("--steps", type=int, default=20, help="cnn, mlp: steps per block")
    parser.add_argument("--warmup-blocks", type=int, default=2, help="untimed blocks first, per preset")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inter-op-threads", type=int, default=2, help="as `tfdp bench` runs its jobs")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    if args.workload == "digits":
        build, x, y = _digits(args.repeats)
    else:
        workers = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        build, x, y = _synthetic(args.workload, int(args.params), args.steps * args.batch_size * workers)
    trainers = {name: PresetTrainer(name, build, x, y, args.batch_size, args.warmup_blocks) for name in args.presets}
    seconds = {name: [] for name in trainers}
    names = list(trainers)
    for block in range(args.blocks):
        shift = block % len(names)  # rotate the order: no preset always runs first
        for name in names[shift:] + names[:shift]:
            seconds[name].append(trainers[name].block())
    picked = {name: trainer.picked() for name, trainer in trainers.items()}
    picked = {name: pick for name, pick in picked.items() if pick}
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "picked": picked}, f)


if __name__ == "__main__":
    main()
