"""Whole data on every rank, then data already split per rank (Horovod style): tfdp warns on every
rank about the second only, for NumPy arrays and (under a second strategy) for tf.data pipelines
that `shard(size, rank)`. Prints a marker line before each fit."""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdp


def main():
    strategy = tfdp.MirroredStrategy()
    rank, size = tfdp.rank(), tfdp.size()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype("float32"), rng.normal(size=(128, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    for case, (xs, ys) in (("whole", (x, y)), ("split per rank", (x[rank::size], y[rank::size]))):
        print(f"case: {case}", file=sys.stderr, flush=True)
        model.fit(xs, ys, batch_size=32, epochs=1, verbose=0)
        model.evaluate(xs, ys, verbose=0)
    strategy = tfdp.MirroredStrategy()  # warns once per strategy
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    for case, data in (("whole tf.data", rows), ("tf.data sharded per rank", rows.shard(size, rank))):
        print(f"case: {case}", file=sys.stderr, flush=True)
        model.fit(data.batch(32), epochs=1, verbose=0)
    print("case: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
