"""One worker of `tfdp bench`: train one workload with one preset and time its steps.

Started by `tfdp.bench` through `tfdp.launcher` (or alone for one worker). Rank 0 writes
one JSON object to ``--out``: per-step wall times of the timed steps, tfdp's payload bytes
over those steps and, on emulated hosts, the bytes that crossed this host's link
(``/sys/class/net/$HOROVOD_GLOO_IFACE/statistics/tx_bytes``) over the same steps.

    python -m tfdp.bench_worker --preset sync --workload mlp --params 6e6 --out /tmp/r.json
"""

import argparse
import json
import math
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402

INPUT_DIM = 1024
CLASSES = 10


def mlp_hidden_width(params):
    """Width h of an MLP 1024-h-h-10 with about `params` parameters."""
    # params = 1024 h + h + h^2 + h + 10 h + 10
    b = INPUT_DIM + 12
    return max(8, int((-b + math.sqrt(b * b + 4 * (params - CLASSES))) / 2))


def build_mlp(params):
    width = mlp_hidden_width(params)
    return keras.Sequential([
        keras.Input((INPUT_DIM,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def build_cnn(_params=None):
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


WORKLOADS = {"mlp": build_mlp, "cnn": build_cnn}


class StepProbe(keras.callbacks.Callback):
    """Wall time, tfdp payload bytes and link bytes at the end of every batch."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        iface = os.environ.get("HOROVOD_GLOO_IFACE", "lo")
        # Loopback carries every worker's traffic: only an emulated host's link is its own.
        self.link_file = None if iface == "lo" else f"/sys/class/net/{iface}/statistics/tx_bytes"
        self.marks = []

    def _link_bytes(self):
        if self.link_file is None:
            return None
        with open(self.link_file) as f:
            return int(f.read())

    def _mark(self):
        stats = self.strategy.communication_stats() if hasattr(self.strategy, "communication_stats") else {}
        self.marks.append((time.perf_counter(), stats.get("payload_bytes", 0), self._link_bytes(),
                           stats.get("gradient_bytes", 0)))

    def on_train_batch_begin(self, batch, logs=None):
        if not self.marks:
            self._mark()

    def on_train_batch_end(self, batch, logs=None):
        self._mark()


def run(preset, workload, params, batch_size, steps, warmup_steps):
    strategy = tfdp.strategy(preset)
    # A preset's own dense warm-up steps are not its steady state.
    warmup_steps += tfdp.presets.load_preset(preset)["options"].get("warmup_steps", 0)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = WORKLOADS[workload](params)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    total = warmup_steps + steps
    # `batch_size` is per worker, so every job does the same work per worker and step.
    global_batch = batch_size * strategy.num_replicas_in_sync
    x = np.random.default_rng(0).normal(size=(total * global_batch, *model.input_shape[1:])).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, size=total * global_batch)
    probe = StepProbe(strategy)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
    if hasattr(strategy, "finish"):
        strategy.finish(model.optimizer)
    timed = probe.marks[warmup_steps:]
    seconds = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    span = timed[-1][0] - timed[0][0]
    link = None if timed[0][2] is None else (timed[-1][2] - timed[0][2]) / steps
    return {
        "preset": preset, "workload": workload, "parameters": int(model.count_params()),
        "batch_size": batch_size, "steps": steps, "warmup_steps": warmup_steps,
        "step_seconds": seconds, "median_seconds": statistics.median(seconds),
        "seconds_per_step": span / steps,
        "payload_bytes_per_step": (timed[-1][1] - timed[0][1]) / steps,
        "gradient_bytes_per_step": (timed[-1][3] - timed[0][3]) / steps,
        "link_bytes_per_step": link,
        "threads": int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0")), "shapes": [list(v.shape) for v in model.trainable_variables],
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args.preset, args.workload, int(args.params), args.batch_size, args.steps, args.warmup_steps)
    if int(os.environ.get("HOROVOD_RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
