"""Train the digits model once per (strategy configuration, seed) inside one set of workers.

Run under horovodrun (or alone). For every run, rank r appends to ``<out>/rank<r>.json``
the test accuracy, median seconds per step (wall time of each epoch / its steps),
gradient bytes per step and dense bytes per step. Used by
``benchmarks/compression.py``, ``benchmarks/asynchronous.py`` and the convergence tests.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/_digits_worker.py \
        --out /tmp/c --optimizer adam --seeds 0 1 2 --configs sync fp16 topk-1pct
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import keras  # noqa: E402

import tfdp  # noqa: E402
from digits import build_model, load_data  # noqa: E402


def compressed(**options):
    return lambda: tfdp.CompressedStrategy(**options)


def asynchronous(**options):
    return lambda: tfdp.AsyncStrategy(**options)


# name -> strategy factory; "sync" (tfdp.MirroredStrategy) is the baseline.
CONFIGS = {
    "sync": tfdp.MirroredStrategy,
    "fp16": compressed(compressor="fp16"),
    "bf16": compressed(compressor="bf16"),
    "topk-1pct": compressed(compressor={"name": "topk", "ratio": 0.01}),
    "qsgd": compressed(compressor={"name": "qsgd", "levels": 64}, error_feedback=False),
    "efsign": compressed(compressor="efsign"),
    "powersgd-r2": compressed(compressor={"name": "powersgd", "rank": 2}, warmup_steps=20),
    "powersgd-r4": compressed(compressor={"name": "powersgd", "rank": 4}, warmup_steps=20),
    "randomk-10pct": compressed(compressor={"name": "randomk", "ratio": 0.1}, error_feedback=False),
    # Negative control: far too sparse and nothing remembered; must fall outside the band.
    "topk-0.1pct-no-ef": compressed(compressor={"name": "topk", "ratio": 0.001}, error_feedback=False),
    "async-s0": asynchronous(staleness=0),
    "async-s1": asynchronous(staleness=1),
    "async-s2": asynchronous(staleness=2),
    "async-s2-lr": asynchronous(staleness=2, damping="lr"),
    "async-s1-lr": asynchronous(staleness=1, damping="lr"),
    # Negative control for the async band: staleness far beyond the usual 1-2 steps.
    "async-s8": asynchronous(staleness=8),
    "local-h4": asynchronous(sync_every=4),
    "local-h16": asynchronous(sync_every=16),
    "local-h16-warmup": asynchronous(sync_every=16, warmup_steps=40),
}
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
    x_train, y_train, x_test, y_test = load_data(seed)
    strategy = CONFIGS[config]()
    with strategy.scope():
        model = build_model(None, optimizer=OPTIMIZERS[optimizer]())
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
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    path = Path(args.out) / f"rank{os.environ.get('HOROVOD_RANK', '0')}.json"
    results = []
    for seed in args.seeds:
        for config in args.configs:
            results.append(train_once(config, args.optimizer, seed, args.epochs, args.batch_size))
            path.write_text(json.dumps(results))  # Partial results survive a timeout.
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
