"""Misbehave on purpose; the job must end quickly with a clear error on every rank.

    --case NAME              one case; an error ends the job
    --cases NAME NAME ...    bad-input cases one after the other in this job: each must raise
                             a ValueError on every rank (printed as "case NAME: message"),
                             and the next case runs

    --case different-model   rank 1 builds a wider layer
    --case jit               a custom step's tf.function(jit_compile=True) calls strategy.run
    --case optimizer-outside the optimizer object is made and built before the strategy's scope
    --case extra-layer       rank 1 builds one more layer
    --case built-outside     the model is built before the strategy's scope and compiled in it
    --case die               rank 1 SIGKILLs itself during fit
    --case stall             rank 1 stops (sleeps) during fit without exiting
    --case tiny-batch        a global batch of 1 for 2 workers
    --case input-dtype       rank 1 passes int32 inputs (Keras casts float64 to float32 itself)
    --case input-shape       rank 1 passes 5 features (the model takes 4)
"""

import argparse
import os
import signal
import sys
import time

from _common import rank

import keras
import numpy as np
import tensorflow as tf

import tfdp


class DieAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class StallAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and rank() == 1:
            time.sleep(3600)


def run_case(case):
    optimizer = "sgd"
    if case == "optimizer-outside":  # made and used outside the scope (one never used is adopted)
        optimizer = keras.optimizers.SGD()
        optimizer.build([keras.Variable(np.zeros((4, 12), "float32"))])
    strategy = tfdp.MirroredStrategy()
    width = 13 if (case == "different-model" and rank() == 1) else 12
    outside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(12)]) if case == "built-outside" else None
    with strategy.scope():
        layers = [keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(1)]
        if case == "extra-layer" and rank() == 1:
            layers.append(keras.layers.Dense(1))
        model = outside or keras.Sequential(layers)
        model.compile(optimizer=optimizer, loss="mse")
    if case == "jit":  # compile(jit_compile=True) falls back to False; a custom XLA step cannot
        xla_step = tf.function(lambda features: strategy.run(model, args=(features,)), jit_compile=True)
        xla_step(np.ones((8, 4), "float32"))
    features = 5 if (case == "input-shape" and rank() == 1) else 4
    dtype = "int32" if (case == "input-dtype" and rank() == 1) else "float32"
    x = np.ones((4096, features), dtype)
    callbacks = {"die": [DieAtBatch()], "stall": [StallAtBatch()]}.get(case, [])
    model.fit(x, x[:, :1], batch_size=1 if case == "tiny-batch" else 8, epochs=50, verbose=0, callbacks=callbacks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case")
    parser.add_argument("--cases", nargs="+")
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return
    for case in args.cases:
        start = time.monotonic()
        try:
            run_case(case)
        except ValueError as err:
            message = " ".join(str(err).split())  # one line (tf.function prefixes "in user code:" and a trace)
            print(f"case {case}: {time.monotonic() - start:.1f} s: {message}", file=sys.stderr, flush=True)
        else:
            raise SystemExit(f"case {case} did not raise")


if __name__ == "__main__":
    main()
