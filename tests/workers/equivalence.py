"""Train a fixed model on fixed data; write final weights and the per-step loss history.

    --model mlp|bn      small MLP with momentum SGD, or a conv net with synchronized BN
    --mode tfdp         tfdp.MirroredStrategy (run under horovodrun)
           plain        one plain Keras process, no strategy (the reference)
           tf-mirrored  tf.distribute.MirroredStrategy on two logical CPU devices
           no-average   tfdp, but gradients are not exchanged (negative control)
"""

import argparse

from _common import weights_as_lists, write_result

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 64


def data(model_kind):
    rng = np.random.default_rng(123)
    if model_kind == "mlp":
        x = rng.normal(size=(GLOBAL_BATCH * 6, 10)).astype("float32")
        y = (x @ rng.normal(size=(10, 1)) + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
    else:
        x = rng.normal(size=(GLOBAL_BATCH * 4, 6, 6, 2)).astype("float32")
        y = rng.integers(0, 3, size=(len(x),)).astype("int32")
    return x, y


def build(model_kind):
    keras.utils.set_random_seed(7)
    if model_kind == "mlp":
        model = keras.Sequential([
            keras.Input((10,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    else:
        model = keras.Sequential([
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(8, 3),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


class StepLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def strategy_for(mode):
    if mode == "plain":
        return tf.distribute.get_strategy()
    if mode == "tf-mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    import tfdp

    from tfdp.reducers import GradientReducer

    class KeepLocalGradients(GradientReducer):
        def _reduce(self, grads, variables, opt):
            return grads

    strategy = tfdp.MirroredStrategy()
    if mode == "no-average":
        strategy.extended.gradient_reducer = KeepLocalGradients(strategy.extended.communicator)
    return strategy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "bn"], required=True)
    parser.add_argument("--mode", choices=["tfdp", "plain", "tf-mirrored", "no-average"], required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    strategy = strategy_for(args.mode)
    x, y = data(args.model)
    with strategy.scope():
        model = build(args.model)
    steps = StepLosses()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=args.epochs, shuffle=False,
                        verbose=0, callbacks=[steps])
    result = {
        "weights": weights_as_lists(model),
        "step_losses": steps.losses,
        "epoch_losses": history.history["loss"],
    }
    if hasattr(strategy, "communication_stats"):
        result["stats"] = strategy.communication_stats()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
