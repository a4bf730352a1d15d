"""Time per step of bounded staleness against synchronous exchange, over a slow exchange.

Run under horovodrun by ``benchmarks/asynchronous.py``. In each round every variant
builds a fresh model and fits ``--steps`` steps on synthetic data; variants alternate
inside the same two processes so that machine load hits them alike. Writes, per rank,
each variant's seconds per step per round and its mean exchange time.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402


def variants(delay):
    return {
        # Shipped presets with explicit overrides (`tfdp.presets` variants).
        "mirrored": lambda: tfdp.strategy("sync:global_step_logs=false"),
        "compute-only": lambda: tfdp.strategy("async-s1:staleness=0"),
        "sync-slow-link": lambda: tfdp.strategy(f"async-s1:staleness=0,exchange_delay_seconds={delay}"),
        "s1-slow-link": lambda: tfdp.strategy(f"async-s1:exchange_delay_seconds={delay}"),
        "s2-slow-link": lambda: tfdp.strategy(f"async-s2:damping=null,exchange_delay_seconds={delay}"),
    }


class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def time_variant(make, x, y, steps, batch, width):
    strategy = make()
    with strategy.scope():
        model = keras.Sequential([keras.Input((x.shape[1],)),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = StepTimes()
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    warm = 5  # tracing and the pipeline filling up
    seconds = (timer.ends[-1] - timer.ends[warm]) / (len(timer.ends) - 1 - warm)
    stats = strategy.communication_stats()
    exchange = stats.get("exchange_seconds", 0.0) / max(1, stats["steps"])
    return seconds, exchange


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=2048)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.steps * args.global_batch
    x = rng.normal(size=(n, 784)).astype("float32")
    y = rng.integers(0, 10, n)
    table = variants(args.delay)
    results = {name: {"seconds": [], "exchange": []} for name in table}
    for _ in range(args.rounds):
        for name, make in table.items():
            seconds, exchange = time_variant(make, x, y, args.steps, args.global_batch, args.width)
            results[name]["seconds"].append(seconds)
            results[name]["exchange"].append(exchange)
    rank = os.environ.get("HOROVOD_RANK", "0")
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"args": vars(args), "results": results}))
    if rank == "0":
        print({k: round(1000 * statistics.median(v["seconds"]), 1) for k, v in results.items()})


if __name__ == "__main__":
    main()
