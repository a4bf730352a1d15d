"""One benchmark worker: time training steps of one variant, write steps/s to --out.

    --variant tfdp | horovod-loop | mwms
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def build_model(width, depth):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((784,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def data(global_batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * steps, 784)).astype("float32")
    y = rng.integers(0, 10, size=(global_batch * steps,)).astype("int32")
    return x, y


def patch_keras_for_mwms(strategy):
    """Keras 3 builds the model from the first batch and cannot convert MWMS's
    PerReplica batches (keras/src/backend/tensorflow/trainer.py,
    `_maybe_symbolic_build`). Benchmark-only patch: build from the local values."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v,
                    next(it),
                )
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build

    # Same file, `reduce_per_replica`: under MWMS it reduces scalar metrics with
    # axis=0, which fails. Reduce them with axis=None.
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy_, reduction):
        if reduction in ("auto", "mean"):
            return tf.nest.map_structure(lambda v: strategy_.reduce("MEAN", v, axis=None), values)
        return original(values, strategy_, reduction)

    trainer.reduce_per_replica = reduce_per_replica


def time_fit(strategy, args):
    with strategy.scope():
        model = build_model(args.width, args.depth)
    x, y = data(args.global_batch, args.steps)
    model.fit(x[: args.global_batch * 5], y[: args.global_batch * 5], batch_size=args.global_batch, verbose=0)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.global_batch, epochs=1, verbose=0, shuffle=False)
        rates.append(args.steps / (time.perf_counter() - start))
    return rates


def time_horovod_loop(args):
    import horovod.tensorflow as hvd

    hvd.init()
    model = build_model(args.width, args.depth)
    optimizer, loss_fn = model.optimizer, model.loss
    local = args.global_batch // hvd.size()
    x, y = data(args.global_batch, args.steps)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(local).prefetch(2)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for xb, yb in dataset.take(5):
        step(xb, yb)
    for v in model.variables:
        v.assign(hvd.broadcast(v, 0))
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for xb, yb in dataset:
            loss = step(xb, yb)
        float(loss)
        rates.append(args.steps / (time.perf_counter() - start))
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, choices=["tfdp", "horovod-loop", "mwms"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    if args.variant == "tfdp":
        import tfdp

        rates, rank = time_fit(tfdp.MirroredStrategy(), args), tfdp.rank()
    elif args.variant == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        patch_keras_for_mwms(strategy)
        rates, rank = time_fit(strategy, args), strategy.cluster_resolver.task_id
    else:
        import horovod.tensorflow as hvd

        rates, rank = time_horovod_loop(args), hvd.rank()
    with open(os.path.join(args.out, f"{args.variant}-rank{rank}.json"), "w") as f:
        json.dump({"steps_per_second": rates}, f)


if __name__ == "__main__":
    main()
