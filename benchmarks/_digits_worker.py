"""Train the digits model once per (preset variant, seed) inside one set of workers.

Configurations are shipped presets, optionally with explicit overrides
(``topk-1pct:compressor.ratio=0.001,error_feedback=false``; see `tfdp.presets`).
Run under horovodrun (or alone). For every run, rank r appends to ``<out>/rank<r>.json``
the test accuracy, median seconds per step (wall time of each epoch / its steps),
gradient bytes per step and dense bytes per step. Used by
``benchmarks/compression.py``, ``benchmarks/asynchronous.py`` and the convergence tests.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/_digits_worker.py \
        --out /tmp/c --optimizer adam --seeds 0 1 2 --configs sync fp16 topk-1pct async-s1:staleness=8
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.tools.workloads import build_digits_model, load_digits_split  # noqa: E402


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(2e-3),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def train_once(config, optimizer, seed, epochs, batch_size):
    keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    strategy = tfdp.strategy(config)
    with strategy.scope():
        model = build_digits_model(OPTIMIZERS[optimizer]())
    timer = EpochTimer()
    logger = tfdp.callbacks.CommunicationLogger()
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0,
                        callbacks=[timer, logger])
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    steps_per_epoch = -(-len(x_train) // batch_size)
    # The first epoch includes tracing; the median of the rest is the steady state.
    seconds = timer.seconds[1:] or timer.seconds
    return {
        "config": config, "optimizer": optimizer, "seed": seed, "accuracy": float(accuracy),
        "seconds_per_step": statistics.median(seconds) / steps_per_epoch,
        "gradient_bytes_per_step": history.history["gradient_bytes_per_step"][-1],
        "dense_bytes_per_step": history.history["dense_bytes_per_step"][-1],
        "final_loss": history.history["loss"][-1],
        "stats": strategy.communication_stats(),
        "weights_checksum": float(sum(abs(w).sum() for w in model.get_weights())),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--configs", nargs="+", required=True, help="presets or variants (NAME:key=value,...)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    for config in args.configs:
        tfdp.presets.resolve_variant(config)  # an unknown preset fails before any training

    path = Path(args.out) / f"rank{os.environ.get('HOROVOD_RANK', '0')}.json"
    results = []
    for seed in args.seeds:
        for config in args.configs:
            results.append(train_once(config, args.optimizer, seed, args.epochs, args.batch_size))
            path.write_text(json.dumps(results))  # Partial results survive a timeout.
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
