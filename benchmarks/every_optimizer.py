"""Every Keras optimizer under every preset on 2 workers: does it run, do the ranks agree, how far
from one process, what accuracy. Real data (scikit-learn's digits), a 64-64-64-10 MLP, global batch
64, `--epochs` epochs unshuffled; each rank also trains the same model alone, as one process would,
for the reference. Rank 0 prints one row per optimizer: test accuracy, ``≠ranks`` when the ranks'
weights differ, and the largest weight difference from one process (sync and zero1: rounding; the
other presets change the algorithm, so theirs is a distance, not an error).

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/every_optimizer.py \\
        [--epochs 6] [--optimizers adam lion] [--presets sync zero1]
"""

import argparse
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfdp  # noqa: E402


def multi_optimizer():
    adam, momentum_sgd = keras.optimizers.Adam(0.003), keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.MultiOptimizer(lambda variable: adam if "first" in variable.path else momentum_sgd)


OPTIMIZERS = {
    "SGD(momentum)": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "Adam": lambda: keras.optimizers.Adam(0.003),
    "Nadam": lambda: keras.optimizers.Nadam(0.003),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "RMSprop(momentum)": lambda: keras.optimizers.RMSprop(0.002, momentum=0.5),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Adafactor": lambda: keras.optimizers.Adafactor(),
    "Lion": lambda: keras.optimizers.Lion(0.0005),
    "Lamb": lambda: keras.optimizers.Lamb(0.01),
    "Muon": lambda: keras.optimizers.Muon(learning_rate=0.01),
    "ScheduleFreeAdamW": lambda: keras.optimizers.ScheduleFreeAdamW(0.003),
    "MultiOptimizer": multi_optimizer,
    "LossScaleOptimizer(Adam)": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.003)),
}
PRESETS = ["sync", "zero1", "topk-1pct", "efsign", "powersgd-r4", "fp16", "async-s1", "local-sgd-h16"]


def digits():
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def train(strategy, make_optimizer, epochs, train_data, test_data):
    """Test accuracy and all weights, flat, after `epochs` (one process when `strategy` is None)."""
    with strategy.scope() if strategy is not None else tf.name_scope("one_process"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu", name="first"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=make_optimizer(), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*train_data, batch_size=64, epochs=epochs, verbose=0, shuffle=False)
    accuracy = model.evaluate(*test_data, verbose=0, return_dict=True)["accuracy"]
    return accuracy, np.concatenate([np.ravel(w) for w in model.get_weights()])


def cell(preset, make_optimizer, reference, args, train_data, test_data):
    try:
        accuracy, weights = train(tfdp.strategy(preset), make_optimizer, args.epochs, train_data, test_data)
    except Exception as error:  # noqa: BLE001 - a probe reports every failure and goes on
        where = traceback.format_exc().strip().splitlines()[-3].strip()
        return f"{type(error).__name__}: {str(error)[:150]} ({where[:100]})"
    # NaN weights count as differing: compare their checksums' bit patterns, not their values.
    checksum = tf.constant([[float(np.sum(weights)), float(np.sum(np.abs(weights)))]], tf.float64)
    gathered = hvd.allgather(checksum).numpy()
    same = gathered[0].tobytes() == gathered[1].tobytes()
    distance = float(np.max(np.abs(weights - reference))) if reference is not None else float("nan")
    return f"{accuracy:.3f}{'' if same else ' ≠ranks'} ({distance:.0e})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    args = parser.parse_args()
    hvd.init()
    train_data, test_data = digits()
    if hvd.rank() == 0:
        print(f"| optimizer | one process | {' | '.join(args.presets)} |")
        print(f"|---|---|{'---|' * len(args.presets)}")
    for name in args.optimizers:
        accuracy, reference = train(None, OPTIMIZERS[name], args.epochs, train_data, test_data)
        cells = [cell(p, OPTIMIZERS[name], reference, args, train_data, test_data) for p in args.presets]
        if hvd.rank() == 0:
            print(f"| {name} | {accuracy:.3f} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
