"""CompressedStrategy and DistributedOptimizer(compression=...) under horovodrun.

For each compressor: fit an MLP for a few steps, record the weight checksum after every
batch, the communication stats around the steps, the variable shapes (for the test to
compute the expected bytes on its own), and the final weights.
"""

import argparse
import os
from pathlib import Path

import _common  # noqa: F401 (quiet TF logs)
import keras
import numpy as np
import tensorflow as tf

import tfdp

COMPRESSORS = {
    "none": {"compressor": "none"},
    "fp16": {"compressor": "fp16"},
    "bf16": {"compressor": "bf16"},
    "topk": {"compressor": {"name": "topk", "ratio": 0.01}},
    "qsgd": {"compressor": {"name": "qsgd", "levels": 64}, "error_feedback": False},
    "efsign": {"compressor": "efsign"},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 4}, "warmup_steps": 2},
    "powersgd-alternate": {"compressor": {"name": "powersgd", "rank": 4, "alternate": True}, "warmup_steps": 2},
    "randomk": {"compressor": {"name": "randomk", "ratio": 0.05}, "error_feedback": False},
}
# Under Adam, "auto" compresses each worker's optimizer step instead of its gradient.
ADAM_CASES = {"topk-adam": "topk", "qsgd-adam": "qsgd", "efsign-adam": "efsign"}
STEPS = 8


def mlp():
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(STEPS * 32, 784)).astype("float32"), rng.integers(0, 10, STEPS * 32)


class Checksums(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(float(sum(np.abs(w).sum() for w in self.model.get_weights())))


def fit_case(name, out):
    keras.utils.set_random_seed(1)
    strategy = tfdp.CompressedStrategy(**COMPRESSORS[ADAM_CASES.get(name, name)])
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.Adam(1e-3) if name in ADAM_CASES else keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    checksums = Checksums()
    logger = tfdp.callbacks.CommunicationLogger(log_dir=Path(out) / f"tb-{name}")
    before = strategy.communication_stats()
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[checksums, logger])
    after = strategy.communication_stats()
    result = {
        "shapes": [list(v.shape) for v in model.trainable_variables],
        "before": before, "after": after,
        "checksums": checksums.values,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "weights": [w.ravel()[:50].tolist() for w in model.get_weights()],
        "compresses_updates": strategy.gradient_reducer.compresses_updates,
        "optimizer_state": [np.asarray(v).ravel()[:50].tolist() for v in model.optimizer.variables[1:]],
    }
    if name == "topk" and strategy.is_chief:
        path = Path(out) / "topk.keras"
        model.save(path)
        result["saved"] = str(path)
    return result


def custom_loop(out):
    """DistributedOptimizer(compression="fp16") in a hand-written loop."""
    keras.utils.set_random_seed(1)
    model = mlp()
    model.build((None, 784))
    # Rank-dependent start on purpose: the broadcast below must make them equal.
    for v in model.trainable_variables:
        v.assign(v + 0.01 * tfdp.rank())
    optimizer = tfdp.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="fp16")
    communicator = tfdp.comm.HorovodCommunicator()
    for v in model.trainable_variables:
        v.assign(communicator.broadcast(tf.convert_to_tensor(v)))
    x, y = data()
    shard = slice(tfdp.rank() * 16, tfdp.rank() * 16 + 16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for i in range(STEPS):
        batch = slice(i * 32, i * 32 + 32)
        step(x[batch][shard], y[batch][shard])
    return {"stats": optimizer.communication_stats(),
            "weights": [w.ravel()[:50].tolist() for w in model.get_weights()]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", default=sorted(COMPRESSORS) + sorted(ADAM_CASES) + ["custom-loop"])
    args = parser.parse_args()
    results = {}
    for case in args.cases:
        results[case] = custom_loop(args.out) if case == "custom-loop" else fit_case(case, args.out)
    _common.write_result(args.out, results)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
