"""tfdp.DistributedOptimizer without a strategy: custom loops and plain fit.

    --mode plain   one process, full global batches (the reference)
    --mode tfdp    each rank trains on its share of every global batch
"""

import argparse

from _common import rank, weights_as_lists, write_result

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH, STEPS = 64, 20


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(1)])


def data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 1))).astype("float32")


def custom_loop(make_optimizer, micro_batches, share):
    """Train STEPS global steps; each rank feeds `micro_batches` slices of its share per step."""
    x, y = data()
    model = build(seed=1)
    optimizer = make_optimizer()
    loss_fn = keras.losses.MeanSquaredError()
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        xb, yb = share(x[rows]), share(y[rows])
        for xm, ym in zip(np.array_split(xb, micro_batches), np.array_split(yb, micro_batches)):
            with tf.GradientTape() as tape:
                loss = loss_fn(ym, model(xm))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return model, optimizer


def multi_optimizer():
    """Adam for the first layer's variables, momentum SGD for the rest, chosen by a callable."""
    adam, momentum_sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.MultiOptimizer(lambda variable: adam if variable.shape[-1] == 12 else momentum_sgd)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "tfdp"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {}

    if args.mode == "plain":
        model, _ = custom_loop(lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5), 1, lambda a: a)
        result["clipped_loop"] = weights_as_lists(model)
        model, _ = custom_loop(lambda: keras.optimizers.SGD(0.1), 1, lambda a: a)
        result["accumulated_loop"] = weights_as_lists(model)
        model, _ = custom_loop(multi_optimizer, 1, lambda a: a)
        result["multi_optimizer_loop"] = weights_as_lists(model)
        result["multi_optimizer_fp16_loop"] = result["multi_optimizer_loop"]
        write_result(args.out, result)
        return

    import tfdp
    from tfdp.strategies.data import rank_rows

    size = tfdp.size()

    def share(a):
        start, stop = rank_rows(len(a), tfdp.rank(), size)
        return a[start:stop]

    model, opt = custom_loop(
        lambda: tfdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5)), 1, share)
    result["clipped_loop"] = weights_as_lists(model)
    result["clipped_loop_stats"] = opt.communication_stats()
    model, opt = custom_loop(
        lambda: tfdp.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2), 2, share)
    result["accumulated_loop"] = weights_as_lists(model)
    result["accumulated_loop_stats"] = opt.communication_stats()
    model, opt = custom_loop(lambda: tfdp.DistributedOptimizer(multi_optimizer()), 1, share)
    result["multi_optimizer_loop"] = weights_as_lists(model)
    result["multi_optimizer_loop_stats"] = opt.communication_stats()
    model, opt = custom_loop(lambda: tfdp.DistributedOptimizer(multi_optimizer(), compression="fp16"), 1, share)
    result["multi_optimizer_fp16_loop"] = weights_as_lists(model)
    result["multi_optimizer_fp16_loop_stats"] = opt.communication_stats()

    # Plain fit, Horovod style: rank-dependent initial weights and data shards.
    x, y = data()
    model = build(seed=100 + rank())
    optimizer = tfdp.DistributedOptimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(
        x[rank()::size], y[rank()::size], batch_size=GLOBAL_BATCH // size, epochs=2, verbose=0,
        callbacks=[tfdp.callbacks.BroadcastGlobalVariables(0), tfdp.callbacks.MetricAverage()],
    )
    result["fit_weights"] = weights_as_lists(model)
    result["fit_loss"] = history.history["loss"]
    result["fit_stats"] = optimizer.communication_stats()
    result["optimizer_class"] = type(model.optimizer).__name__
    write_result(args.out, result)


if __name__ == "__main__":
    main()
