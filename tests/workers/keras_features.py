"""Train with many Keras features at once; write weights, history and what each rank wrote.

    --mode plain|tfdp            reference process or tfdp.MirroredStrategy
    --precision float32|mixed    mixed: mixed_float16 (Keras adds a LossScaleOptimizer)
    --files DIR                  where ModelCheckpoint/TensorBoard/BackupAndRestore write
"""

import argparse
from pathlib import Path

from _common import rank, weights_as_lists, write_result

import keras
import numpy as np
import tensorflow as tf


class CountingCheckpoint(keras.callbacks.ModelCheckpoint):
    saves = 0

    def _save_model(self, *args, **kwargs):
        CountingCheckpoint.saves += 1
        return super()._save_model(*args, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "tfdp"], required=True)
    parser.add_argument("--precision", choices=["float32", "mixed"], default="float32")
    parser.add_argument("--files", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.precision == "mixed":
        keras.mixed_precision.set_global_policy("mixed_float16")

    if args.mode == "tfdp":
        import tfdp

        strategy = tfdp.MirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()

    rng = np.random.default_rng(5)
    x = rng.normal(size=(1024, 12)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0.5).astype("int32")
    x_val, y_val = x[:128], y[:128]
    files = Path(args.files)

    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((12,)),
            keras.layers.Dense(24, activation="relu"),
            keras.layers.Dense(2),
        ])
        # clipnorm small enough to clip every step: clipping local instead of averaged
        # gradients would change the trajectory.
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1.0),
        CountingCheckpoint(str(files / "best.weights.h5"), save_weights_only=True),
        keras.callbacks.TensorBoard(str(files / "tb")),
        keras.callbacks.BackupAndRestore(str(files / "backup"), delete_checkpoint=False),
    ]
    history = model.fit(
        x, y, batch_size=64, epochs=4, steps_per_epoch=4, shuffle=False,
        validation_data=(x_val, y_val), class_weight={0: 1.0, 1: 3.0},
        callbacks=callbacks, verbose=0,
    )
    result = {
        "weights": weights_as_lists(model),
        "history": history.history,
        "checkpoint_saves": CountingCheckpoint.saves,
        "optimizer": type(model.optimizer).__name__,
    }
    if args.precision == "float32":
        if rank() == 0:
            model.save(files / "model.keras")  # Chief-only save must not need the other rank.
        result["predictions"] = model.predict(x[:10], verbose=0).tolist()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
