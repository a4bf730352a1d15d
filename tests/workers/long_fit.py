"""A long fit that reports every epoch on stderr: a job to break mid-run (host loss tests)."""

import sys

from _common import rank

import keras
import numpy as np

import tfdp


class SayEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"rank {rank()} epoch {epoch} done", file=sys.stderr, flush=True)


def main():
    strategy = tfdp.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
    model.fit(x, x[:, :1], batch_size=64, epochs=1000, verbose=0, callbacks=[SayEpoch()])


if __name__ == "__main__":
    main()
