"""Misbehave on purpose; the job must end quickly with a clear error on every rank.

    --case different-model   rank 1 builds a wider layer
    --case jit               compile(jit_compile=True)
    --case extra-layer       rank 1 builds one more layer
    --case die               rank 1 SIGKILLs itself during fit
    --case stall             rank 1 stops (sleeps) during fit without exiting
    --case tiny-batch        a global batch of 1 for 2 workers
    --case input-dtype       rank 1 passes int32 inputs (Keras casts float64 to float32 itself)
    --case input-shape       rank 1 passes 5 features (the model takes 4)
"""

import argparse
import os
import signal
import time

from _common import rank

import keras
import numpy as np

import tfdp


class DieAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class StallAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and rank() == 1:
            time.sleep(3600)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    args = parser.parse_args()
    strategy = tfdp.MirroredStrategy()
    width = 13 if (args.case == "different-model" and rank() == 1) else 12
    with strategy.scope():
        layers = [keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(1)]
        if args.case == "extra-layer" and rank() == 1:
            layers.append(keras.layers.Dense(1))
        model = keras.Sequential(layers)
        model.compile(optimizer="sgd", loss="mse", jit_compile=args.case == "jit")
    features = 5 if (args.case == "input-shape" and rank() == 1) else 4
    dtype = "int32" if (args.case == "input-dtype" and rank() == 1) else "float32"
    x = np.ones((4096, features), dtype)
    callbacks = {"die": [DieAtBatch()], "stall": [StallAtBatch()]}.get(args.case, [])
    model.fit(x, x[:, :1], batch_size=1 if args.case == "tiny-batch" else 8, epochs=50, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main()
