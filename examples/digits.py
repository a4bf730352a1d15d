"""Train a digit classifier on scikit-learn's digits (8x8 images, 10 classes).

    python examples/digits.py                                          # one process
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py   # two workers
    TFDP_STRATEGY=sync horovodrun -np 2 ... python examples/digits.py  # pick a preset

The only distributed-specific line is the strategy. ``batch_size`` is the global
batch, so the script trains the same way on any number of workers.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdp  # noqa: E402


def load_data(seed):
    """Return (x_train, y_train, x_test, y_test), pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def build_model(learning_rate, optimizer=None):
    """The conv net, compiled with `optimizer` (default: Adam at `learning_rate`)."""
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)

    strategy = tfdp.strategy()  # the distributed line: $TFDP_STRATEGY, default "sync"
    with strategy.scope():
        model = build_model(args.learning_rate)
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
