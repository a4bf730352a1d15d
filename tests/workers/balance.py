"""Digits under uneven static shares (or one plain process as the reference).

    --balance 0.7,0.3   MirroredStrategy(balance=[0.7, 0.3]) ("auto" for measured shares); omit for the
                        one-process reference
    --epochs N          epochs over those batches (default 1)
    TFDP_SLOWDOWN=1:2   rank 1 computes 2x slower (a CPU quota, `tfdp.tools.slowdown`; root)
    --model mlp|conv|wide  conv: a conv net with synchronized batch norm; wide: a 2048-2048 MLP
    --batches N         train on the first N global batches of 64 rows (one epoch, shuffle=False)
    --unweighted        negative control: gradients averaged without weighting by rows
    --bucket-bytes N    all-reduce gradients in buckets of about N bytes

Rank r writes rank<r>.json: the final weights, the logged loss and accuracy, each rank's
rows per step and `balance_stats()`.
"""

import argparse
import os

import _common
import keras

import tfdp
from tfdp.tools.slowdown import apply_from_env
from tfdp.tools.workloads import load_digits_split

BATCH = 64


def build(kind):
    layers = [keras.Input((8, 8, 1))]
    if kind == "wide":  # enough compute per row (~0.5 ms) for a CPU quota to show in every step
        layers += [keras.layers.Flatten(), keras.layers.Dense(2048, activation="relu"),
                   keras.layers.Dense(2048, activation="relu")]
    elif kind == "conv":
        layers += [keras.layers.Conv2D(8, 3, activation="relu"),
                   keras.layers.BatchNormalization(synchronized=True),
                   keras.layers.Flatten()]
    else:
        layers += [keras.layers.Flatten(), keras.layers.Dense(32, activation="relu")]
    model = keras.Sequential(layers + [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class RowsPerStep(keras.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        balancer = self.strategy.extended.balancer if self.strategy is not None else None
        if balancer is not None:
            self.rows.append(int(balancer.epoch_rows.numpy()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--balance")
    parser.add_argument("--model", choices=["mlp", "conv", "wide"], default="mlp")
    parser.add_argument("--batches", type=int, default=23)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, help="MirroredStrategy(bucket_bytes=...)")
    parser.add_argument("--shard", action="store_true", help="MirroredStrategy(shard_optimizer_state=True)")
    parser.add_argument("--unweighted", action="store_true",
                        help="negative control: the gradient exchange ignores the rows (a plain mean)")
    args = parser.parse_args()
    apply_from_env()
    keras.utils.set_random_seed(0)
    x, y, x_test, y_test = load_digits_split(0)
    rows = min(len(x), args.batches * BATCH)
    x, y = x[:rows], y[:rows]
    strategy = None
    if args.balance or args.bucket_bytes:
        balance = None
        if args.balance:
            balance = "auto" if args.balance == "auto" else [float(w) for w in args.balance.split(",")]
        strategy = tfdp.MirroredStrategy(balance=balance, shard_optimizer_state=args.shard,
                                         bucket_bytes=None if args.shard else args.bucket_bytes)
        if args.unweighted:
            strategy.gradient_reducer.weights_rows = False
        with strategy.scope():
            model = build(args.model)
    else:
        model = build(args.model)
    counter = RowsPerStep(strategy)
    history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[counter])
    evaluation = model.evaluate(x_test, y_test, batch_size=BATCH, verbose=0, return_dict=True)
    _common.write_result(args.out, {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "slowdown": os.environ.get("TFDP_SLOWDOWN"),
        "evaluate": {k: float(v) for k, v in evaluation.items()},
        "epoch_rows": counter.rows,
        "stats": strategy.balance_stats() if strategy is not None else None,
        "collectives": strategy.communication_stats()["collectives"] if strategy is not None else None,
        "steps": int(model.optimizer.iterations.numpy()),
        "rows": rows,
    })


if __name__ == "__main__":
    main()
