"""Benchmark worker: time blocks of training steps, write steps/s per block to --out.

    --variant paired   (under horovodrun) tfdp + fit, a hand-written Horovod loop and
                       diagnostics, alternating blocks in the same processes
    --variant mwms     (with TF_CONFIG) tf.distribute.MultiWorkerMirroredStrategy + fit
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


class FitTrainer:
    """model.fit over `steps` global batches (the model's strategy decides the rest)."""

    def __init__(self, model, x, y, batch_size):
        self.model, self.x, self.y, self.batch_size = model, x, y, batch_size
        model.fit(x[: batch_size * 5], y[: batch_size * 5], batch_size=batch_size, verbose=0)

    def block(self):
        self.model.fit(self.x, self.y, batch_size=self.batch_size, epochs=1, verbose=0, shuffle=False)


class LoopTrainer:
    """Hand-written Horovod loop: tf.function step, grouped all-reduce of the gradients."""

    def __init__(self, model, x, y, local_batch, metric_allreduce=False):
        import horovod.tensorflow as hvd

        optimizer, loss_fn = model.optimizer, model.loss
        self.dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(local_batch).prefetch(2)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = hvd.grouped_allreduce(tape.gradient(loss, model.trainable_variables), op=hvd.Average)
            optimizer.apply(grads, model.trainable_variables)
            if metric_allreduce:  # What a fit step also does: make the reported loss global.
                loss = hvd.allreduce(loss, op=hvd.Average)
            return loss

        self.step = step
        for xb, yb in self.dataset.take(5):
            step(xb, yb)

    def block(self):
        for xb, yb in self.dataset:
            loss = self.step(xb, yb)
        float(loss)


def horovod_fit_model(width, depth):
    """Keras fit without a strategy, gradients all-reduced in a hand-written train_step."""
    import horovod.tensorflow as hvd

    class HorovodSequential(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = hvd.grouped_allreduce(tape.gradient(loss, self.trainable_variables), op=hvd.Average)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    reference = build_model(width, depth)
    model = HorovodSequential(reference.layers)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=reference.loss, jit_compile=False)
    return model


def paired_trainers(args):
    """tfdp fit, hand-written loop and hand-written fit, in the same two processes."""
    import horovod.tensorflow as hvd

    import tfdp

    strategy = tfdp.MirroredStrategy()
    with strategy.scope():
        tfdp_model = build_model(args.width, args.depth)
    # Diagnostic: a second tfdp strategy whose step outputs stay local (no metric exchange).
    local_metrics = tfdp.MirroredStrategy(global_step_logs=False)
    with local_metrics.scope():
        local_metrics_model = build_model(args.width, args.depth)
    # Diagnostic: the gradients in one group, as the hand-written steps send them (no buckets).
    one_group = tfdp.MirroredStrategy(bucket_bytes=None)
    with one_group.scope():
        one_group_model = build_model(args.width, args.depth)

    size, rank = hvd.size(), hvd.rank()
    local = args.global_batch // size
    x, y = data(args.global_batch, args.steps)
    x_shard, y_shard = x[rank::size], y[rank::size]
    return rank, {
        "tfdp": FitTrainer(tfdp_model, x, y, args.global_batch),
        "tfdp-local-metrics": FitTrainer(local_metrics_model, x, y, args.global_batch),
        "tfdp-one-group": FitTrainer(one_group_model, x, y, args.global_batch),
        "horovod-loop": LoopTrainer(build_model(args.width, args.depth), x_shard, y_shard, local),
        "horovod-loop-metric": LoopTrainer(build_model(args.width, args.depth), x_shard, y_shard, local, True),
        "horovod-fit": FitTrainer(horovod_fit_model(args.width, args.depth), x_shard, y_shard, local),
    }


def time_blocks(trainers, args):
    """Alternate timed blocks of every trainer (rotating the order); steps/s per block."""
    names = list(trainers)
    rates = {name: [] for name in names}
    for block in range(args.repeats):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            trainers[name].block()
            rates[name].append(args.steps / (time.perf_counter() - start))
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, choices=["paired", "mwms"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inter-op-threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)

    if args.variant == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        patch_keras_for_mwms(strategy)
        with strategy.scope():
            model = build_model(args.width, args.depth)
        x, y = data(args.global_batch, args.steps)
        rank, trainers = strategy.cluster_resolver.task_id, {"mwms": FitTrainer(model, x, y, args.global_batch)}
    else:
        rank, trainers = paired_trainers(args)
    rates = time_blocks(trainers, args)
    with open(os.path.join(args.out, f"{args.variant}-rank{rank}.json"), "w") as f:
        json.dump(rates, f)


if __name__ == "__main__":
    main()
