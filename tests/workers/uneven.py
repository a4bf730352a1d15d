"""Rank r trains on 256 + 64 r rows (rank 1: 2 more global batches of 32 per epoch).

Rank r writes rank<r>.json to --out: final weights and optimizer iterations.
"""

import argparse

from _common import rank, weights_as_lists, write_result

import keras
import numpy as np

import tfdp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = 256 + 64 * rank()
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = tfdp.MirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)
    write_result(args.out, {"weights": weights_as_lists(model), "iterations": int(model.optimizer.iterations.numpy())})


if __name__ == "__main__":
    main()
