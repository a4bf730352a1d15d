"""Rank 1's share of one global batch holds NaN inputs; trained with skip_nonfinite, then without.

Rank r writes rank<r>.json to --out: for "skip" and "plain", final weights, skipped steps,
optimizer iterations and the weights of a plain Keras reference trained on the same data
without that batch.
"""

import argparse

from _common import rank, weights_as_lists, write_result

import keras
import numpy as np

import tfdp

BATCH, STEPS, EPOCHS, POISONED_STEP = 32, 8, 2, 3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    write_result(args.out, {"skip": train(skip=True), "plain": train(skip=False), "rank": rank()})


def train(skip):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    # Rows of global batch 3 that rank 1 trains on (rank r takes rows [16 r, 16 r + 16) of a batch).
    start = POISONED_STEP * BATCH + BATCH // 2
    x[start:start + 2] = np.nan
    strategy = tfdp.MirroredStrategy(skip_nonfinite=skip)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    initial = model.get_weights()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # A skipped step changes nothing (weights, momentum): training without that batch is the same.
    poisoned = range(POISONED_STEP * BATCH, (POISONED_STEP + 1) * BATCH)
    clean = np.delete(np.arange(len(x)), poisoned)
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    reference.set_weights(initial)
    reference.fit(x[clean], y[clean], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights_as_lists(model), "skipped": strategy.skipped_steps(),
            "iterations": int(model.optimizer.iterations.numpy()), "reference": weights_as_lists(reference)}


if __name__ == "__main__":
    main()
