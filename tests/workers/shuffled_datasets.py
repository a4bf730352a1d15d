"""tf.data pipelines that shuffle: the same order on every rank (a seed, or built after the
strategy shared TF's global seed) says nothing; an order each rank draws for itself (no seed,
built before the strategy) or seeds that differ between ranks are warned about on every rank,
once per kind. Then pipelines that cache to a file (`--folder`): built after the strategy, each
rank writes its own; built before it, the ranks' shared file is a ValueError on every rank.
Prints a marker line before each fit. Run in a fresh process or after other scripts: it clears
TF's global seed first."""

import argparse
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdp


def main():
    tf.random.set_seed(None)  # as in a fresh process: no global seed yet
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype("float32"), rng.normal(size=(128, 1)).astype("float32")
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    seeded = rows.shuffle(128, seed=3).batch(32)
    unseeded = rows.shuffle(128).batch(32)  # built before the strategy: each rank draws its order
    strategy = tfdp.MirroredStrategy()
    after = rows.shuffle(128).batch(32)  # TF's global seed is shared now: every rank draws alike
    # seed=None: the utility draws a seed from NumPy's generator, which differs between processes.
    np.random.seed(tfdp.rank())
    windows = keras.utils.timeseries_dataset_from_array(x, y, sequence_length=1, batch_size=32, shuffle=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    for case, data in (("seeded", seeded), ("built after the strategy", after), ("seeds differ", windows),
                       ("seeds differ again", windows), ("unseeded", unseeded)):
        print(f"case: {case}", file=sys.stderr, flush=True)
        model.fit(data.map(lambda features, target: (tf.reshape(features, [-1, 4]), target)), epochs=1, verbose=0)
    strategy = tfdp.MirroredStrategy()  # warnings are once per strategy
    print("case: custom loop, unseeded", file=sys.stderr, flush=True)
    for _ in strategy.experimental_distribute_dataset(unseeded):
        break

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    folder = parser.parse_args().folder
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    print("case: cached, built after the strategy", file=sys.stderr, flush=True)
    model.fit(rows.cache(os.path.join(folder, "after")).batch(32), epochs=2, verbose=0)
    print(f"cache files: {sorted(os.listdir(folder))}", file=sys.stderr, flush=True)
    # Built before any strategy: Keras's own cache, as in a fresh process (strategies of the
    # scripts run before this one in the same process would otherwise rename the file).
    before = getattr(tf.data.Dataset.cache, "_tfdp_original", tf.data.Dataset.cache)
    print("case: cached, built before the strategy", file=sys.stderr, flush=True)
    try:
        model.fit(before(rows, os.path.join(folder, "before")).batch(32), epochs=1, verbose=0)
    except ValueError as error:
        print(f"refused: {error}", file=sys.stderr, flush=True)
    print("case: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
