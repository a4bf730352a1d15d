"""Exercise the tf.distribute API of tfdp.MirroredStrategy; write what each call returned."""

import argparse
import contextlib
import warnings
from pathlib import Path

from _common import write_result

import keras
import numpy as np
import tensorflow as tf

import tfdp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    strategy = tfdp.MirroredStrategy()  # No seed set: tfdp shares rank 0's.
    rank, size = tfdp.rank(), tfdp.size()

    def rows_seen_by_all_ranks():
        shuffled = tf.data.Dataset.range(16).shuffle(16).batch(8)
        mine = tf.concat(list(strategy.experimental_distribute_dataset(shuffled)), axis=0)
        return sorted(strategy.gather(mine, axis=0).numpy().tolist())

    result = {"shuffled_rows_shared_seed": rows_seen_by_all_ranks()}
    tf.random.set_seed(100 + rank)  # Negative control: every rank its own permutation.
    result["shuffled_rows_own_seeds"] = rows_seen_by_all_ranks()
    result.update(rank=rank, size=size, num_replicas_in_sync=strategy.num_replicas_in_sync)

    per_rank = strategy.run(lambda: tf.constant([float(rank + 1), 10.0 * (rank + 1)]))
    result["local_results_len"] = len(strategy.experimental_local_results(per_rank))
    result["reduce_sum"] = strategy.reduce("SUM", per_rank, axis=None).numpy().tolist()
    result["reduce_mean"] = strategy.reduce("MEAN", per_rank, axis=None).numpy().tolist()
    result["reduce_sum_axis0"] = float(strategy.reduce("SUM", per_rank, axis=0).numpy())
    result["reduce_mean_axis0"] = float(strategy.reduce("MEAN", per_rank, axis=0).numpy())
    matrix = strategy.run(lambda: tf.fill([2, 1 + rank * 0], float(rank)))
    result["gather_axis0"] = strategy.gather(matrix, axis=0).numpy().tolist()
    result["gather_axis1"] = strategy.gather(matrix, axis=1).numpy().tolist()

    @tf.function
    def replica_all_reduce():
        def fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce("SUM", tf.constant(float(rank + 1))), ctx.all_reduce(
                "MEAN", tf.constant(float(rank + 1)))
        return strategy.run(fn)

    total, mean = replica_all_reduce()
    result["replica_all_reduce_sum"] = float(total.numpy())
    result["replica_all_reduce_mean"] = float(mean.numpy())

    dataset = tf.data.Dataset.range(10).batch(4)
    result["distributed_dataset"] = [b.numpy().tolist() for b in strategy.experimental_distribute_dataset(dataset)]

    def dataset_fn(ctx):
        ds = tf.data.Dataset.range(8).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(4))

    result["datasets_from_function"] = [
        b.numpy().tolist() for b in strategy.distribute_datasets_from_function(dataset_fn)
    ]
    result["values_from_function"] = float(
        strategy.experimental_distribute_values_from_function(lambda ctx: float(ctx.replica_id_in_sync_group))
    )

    # predict returns every row, in input order; evaluate reports global metrics.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(103, 5)).astype("float32")
    y = rng.normal(size=(103, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    kernel, bias = model.get_weights()
    expected = x @ kernel + bias
    predicted = model.predict(x, batch_size=16, verbose=0)
    result["predict_shape"] = list(predicted.shape)
    result["predict_max_abs_error"] = float(np.max(np.abs(predicted - expected)))
    loss, mae = model.evaluate(x, y, batch_size=16, verbose=0)
    result["evaluate"] = [loss, mae]
    result["evaluate_expected"] = [float(np.mean((expected - y) ** 2)), float(np.mean(np.abs(expected - y)))]

    class BatchLosses(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.losses = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    for global_step_logs in (True, False):
        step_strategy = tfdp.MirroredStrategy(global_step_logs=global_step_logs)
        keras.utils.set_random_seed(9)
        with step_strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        batch_losses = BatchLosses()
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[batch_losses])
        result[f"global_step_logs={global_step_logs}"] = {
            "batch": batch_losses.losses, "epoch": history.history["loss"]}
    result.update(xla_requested(strategy, x, y))
    result.update(custom_loop_then_settle(x, y))
    result.update(saved_by_every_rank(strategy, x, y, Path(args.out) / "saved"))
    write_result(args.out, result)


def saved_by_every_rank(strategy, x, y, folder):
    """An unchanged script saves on every rank, to one path: only rank 0 writes (also CSVLogger)."""
    rank = tfdp.rank()
    folder.mkdir(exist_ok=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[keras.callbacks.CSVLogger(str(folder / f"log-rank{rank}.csv"))])
    model.save_weights(folder / "model.weights.h5")  # rank 1's write hit HDF5's file lock before
    model.save(folder / "model.keras")
    keras.saving.save_model(model, folder / f"model-rank{rank}.keras")
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # a barrier: rank 0 has written
    loaded = keras.models.load_model(folder / "model.keras")
    loaded.load_weights(folder / "model.weights.h5")
    return {"saved_files": sorted(p.name for p in folder.iterdir()),
            "loaded_equals_own": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), model.get_weights()))}


def custom_loop_then_settle(x, y):
    """tf.distribute's custom loop (strategy.run over experimental_distribute_dataset) under a preset
    whose workers keep their own models (topk-1pct's local residual): `strategy.settle` makes them one."""
    strategy = tfdp.strategy("topk-1pct")
    keras.utils.set_random_seed(9)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(features, labels):
        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(features) - labels) ** 2) / 16  # the global batch
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        strategy.run(replica_step, args=(features, labels))

    for features, labels in strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16)):
        step(features, labels)
    before = [w.tolist() for w in model.get_weights()]
    strategy.settle(optimizer)
    return {"custom_loop_before_settle": before, "custom_loop_after_settle": [w.tolist() for w in model.get_weights()]}


def xla_requested(strategy, x, y):
    """compile(jit_compile=True) under the strategy and under a DistributedOptimizer falls back to
    False (warned on rank 0); a custom step's tf.function(jit_compile=True) is a ValueError."""
    out = {}
    for name in ("strategy", "distributed_optimizer"):
        keras.utils.set_random_seed(9)
        with strategy.scope() if name == "strategy" else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.1)
            model.compile(optimizer=optimizer if name == "strategy" else tfdp.DistributedOptimizer(optimizer),
                          loss="mse", jit_compile=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        out[f"xla_{name}"] = {"jit_compile": model.jit_compile, "weights": [w.tolist() for w in model.get_weights()],
                              "warned": sum("cannot be compiled by XLA" in str(w.message) for w in caught)}
        if name == "distributed_optimizer":
            @tf.function(jit_compile=True)
            def custom_step(features, labels):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(features) - labels) ** 2)
                model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

            try:
                custom_step(x[:8], y[:8])
                out["xla_custom_step_error"] = None
            except ValueError as error:
                out["xla_custom_step_error"] = str(error)
    return out


if __name__ == "__main__":
    main()
