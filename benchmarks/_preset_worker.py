"""Train one workload under several presets (and seeds) inside one set of workers.

Configurations are shipped presets, optionally with explicit overrides
(``topk-1pct:compressor.ratio=0.001,local_residual=false``; see `tfdp.presets`). For every
run, rank r appends to ``<out>/rank<r>.json`` the test accuracy after each of
``--report-epochs`` (one training serves a short and a long budget), the median seconds
per step, the gradient and dense bytes per step and the communication statistics. With
``TFDP_SLOWDOWN=1:2`` rank 1 computes 2x slower (`tfdp.tools.slowdown`). Used by
``benchmarks/preset_grid.py``, ``benchmarks/compression.py`` and the convergence tests.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/_preset_worker.py --out /tmp/c \\
        --dataset digits --model conv --optimizer sgd --batch-size 64 --epochs 20 --report-epochs 12 20 \\
        --seeds 0 1 2 --configs sync topk-1pct async-s1:staleness=8
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
from tfdp.tools.slowdown import apply_from_env  # noqa: E402
from tfdp.tools.workloads import DATASETS, build_classifier_mlp, build_digits_model  # noqa: E402

CLASSES = {"digits": 10, "breast_cancer": 2}
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(2e-3),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "plain-sgd": lambda: keras.optimizers.SGD(0.1),
}


def build(model, dataset, x_train, optimizer):
    if model == "conv":
        if dataset != "digits":
            raise ValueError("The conv net takes 8x8 images: --model conv needs --dataset digits.")
        return build_digits_model(optimizer)
    return build_classifier_mlp(x_train.shape[1:], CLASSES[dataset], optimizer)


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def train_once(args, config, seed):
    keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = DATASETS[args.dataset](seed)
    strategy = tfdp.strategy(config)
    with strategy.scope():
        model = build(args.model, args.dataset, x_train, OPTIMIZERS[args.optimizer]())
    timer = EpochTimer()
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                        validation_data=(x_test, y_test), callbacks=[timer, tfdp.callbacks.CommunicationLogger()])
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    # The first epoch includes tracing; the median of the rest is the steady state.
    seconds = timer.seconds[1:] or timer.seconds
    return {
        "config": config, "dataset": args.dataset, "model": args.model, "optimizer": args.optimizer,
        "batch_size": args.batch_size, "seed": seed,
        "accuracy": {str(e): float(history.history["val_accuracy"][e - 1]) for e in args.report_epochs},
        "seconds_per_step": statistics.median(seconds) / steps_per_epoch,
        "gradient_bytes_per_step": history.history["gradient_bytes_per_step"][-1],
        "dense_bytes_per_step": history.history["dense_bytes_per_step"][-1],
        "final_loss": history.history["loss"][-1],
        "stats": strategy.communication_stats(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="digits")
    parser.add_argument("--model", choices=["conv", "mlp"], default="conv")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--configs", nargs="+", required=True, help="presets or variants (NAME:key=value,...)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--report-epochs", nargs="+", type=int, help="default: the last epoch")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    args = parser.parse_args()
    args.report_epochs = args.report_epochs or [args.epochs]
    apply_from_env()  # TFDP_SLOWDOWN=RANK:FACTOR: that worker computes FACTOR x slower (root)
    for config in args.configs:
        tfdp.presets.resolve_variant(config)  # an unknown preset fails before any training

    path = Path(args.out) / f"rank{os.environ.get('HOROVOD_RANK', '0')}.json"
    results = []
    for seed in args.seeds:
        for config in args.configs:
            results.append(train_once(args, config, seed))
            path.write_text(json.dumps(results))  # Partial results survive a timeout.
            print(json.dumps({k: results[-1][k] for k in ("config", "seed", "accuracy")}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
