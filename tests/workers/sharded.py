"""Digits under `MirroredStrategy(shard_optimizer_state=...)` or plain sync, saving the whole model.

    --shard no|auto|flat|variables|both   shard_optimizer_state (no: plain sync; both: sync, then
                                     auto, in the same processes; --save PATH gets -no / -auto)
    --model mlp|conv                 conv: a conv net with synchronized batch norm
    --optimizer sgdm|adam|adamw      adamw: AdamW with weight decay, biases excluded, global_clipnorm=1
    --clipnorm X                     per-variable clipnorm on the optimizer
    --loss-scale S                   mixed_float16, the optimizer in a LossScaleOptimizer with
                                     initial_scale S (a large S overflows the first steps, which
                                     are skipped while the scale halves)
    --batches N                      the first N global batches of 64 rows (shuffle=False)
    --epochs N
    --load PATH                      start from this saved model's weights and optimizer state
    --save PATH                      rank 0 saves the whole model here at the end (model.save)

Rank r writes rank<r>.json: the final weights, the optimizer's variables on this rank
(count, bytes), `memory_stats`, peak RSS and the communication statistics.
"""

import argparse
import resource

import _common
import keras

import tfdp
from tfdp.tools.workloads import load_digits_split

BATCH = 64


def build(kind, optimizer_name, clipnorm, loss_scale=None):
    layers = [keras.Input((8, 8, 1))]
    if kind == "conv":
        layers += [keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.BatchNormalization(synchronized=True),
                   keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")]
    else:
        layers += [keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"),
                   keras.layers.Dense(64, activation="relu")]
    model = keras.Sequential(layers + [keras.layers.Dense(10)])
    clip = {"clipnorm": clipnorm} if clipnorm else {}
    if optimizer_name == "sgdm":
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, **clip)
    elif optimizer_name == "adam":
        optimizer = keras.optimizers.Adam(2e-3, **clip)
    else:
        optimizer = keras.optimizers.AdamW(2e-3, weight_decay=0.05, global_clipnorm=1.0)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=loss_scale)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard", default="no")
    parser.add_argument("--model", choices=["mlp", "conv"], default="mlp")
    parser.add_argument("--optimizer", choices=["sgdm", "adam", "adamw"], default="adam")
    parser.add_argument("--clipnorm", type=float)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--loss-scale", type=float)
    parser.add_argument("--load")
    parser.add_argument("--save")
    args = parser.parse_args()
    if args.loss_scale:
        keras.mixed_precision.set_global_policy("mixed_float16")
    x, y, _, _ = load_digits_split(0)
    rows = min(len(x), args.batches * BATCH)
    x, y = x[:rows], y[:rows]
    results = {}
    # "both": sync, then sharded, in the same processes (one launch instead of two).
    for mode in (["no", "auto"] if args.shard == "both" else [args.shard]):
        keras.utils.set_random_seed(0)
        shard = {"no": False, "auto": True}.get(mode, mode)
        strategy = tfdp.MirroredStrategy(shard_optimizer_state=shard)
        with strategy.scope():
            model = build(args.model, args.optimizer, args.clipnorm, args.loss_scale)
            if args.load:
                model.optimizer.build(model.trainable_variables)
                model.load_weights(args.load)
        history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0)
        save = args.save and (args.save if args.shard != "both" else f"{args.save[:-len('.keras')]}-{mode}.keras")
        if save and strategy.is_chief:
            model.save(save)
        results[mode] = {
            "weights": _common.weights_as_lists(model),
            "loss": [float(v) for v in history.history["loss"]],
            "steps": int(model.optimizer.iterations.numpy()),
            "loss_scale": float(model.optimizer.dynamic_scale.numpy()) if args.loss_scale else None,
            "memory": strategy.memory_stats(model.optimizer),
            "optimizer_variables": len(model.optimizer.variables),
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "stats": {k: float(v) for k, v in strategy.communication_stats().items() if isinstance(v, (int, float))},
        }
    _common.write_result(args.out, results if args.shard == "both" else results[args.shard])


if __name__ == "__main__":
    main()
