"""Two AutoStrategy jobs in the same processes: the default candidates, and PowerSGD alone.

Rank r writes rank<r>.json to --out: per case the pick and its measurements, the final
weights, whether the loss fell, and the gradient bytes of the last step against a dense one.
"""

import argparse

from _common import weights_as_lists, write_result

import keras
import numpy as np

import tfdp


class LastStepBytes(keras.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.marks = strategy, []

    def on_train_batch_end(self, batch, logs=None):
        self.marks.append(self.strategy.communication_stats()["gradient_bytes"])


def train(strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 40, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    probe = LastStepBytes(strategy)
    history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
    dense = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    return {"stats": strategy.auto_stats(), "weights": weights_as_lists(model),
            "loss_fell": history.history["loss"][0] < float(np.mean(y ** 2)),
            "last_step_gradient_bytes": probe.marks[-1] - probe.marks[-2], "dense_gradient_bytes": dense}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    write_result(args.out, {"default": train(tfdp.strategy("auto:measure_steps=6")),
                            "forced": train(tfdp.AutoStrategy(candidates=["powersgd-r4"], measure_steps=6))})


if __name__ == "__main__":
    main()
