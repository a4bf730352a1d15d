"""Small, ordinary Keras programs, each written once and run three ways by `run.py`.

A program receives `make_strategy` and builds its strategy itself (some programs set seeds
or build other models first). It returns the numbers to compare: final weights, the
History, and where it makes sense evaluate() and predict() results. Every program seeds
what it draws, so one process, `tf.distribute.MirroredStrategy` and tfdp start from the
same weights and data.

``PROGRAMS[name] = (function, reference)``: reference ``"plain"`` when the program must
match one plain process, ``"tf-mirrored"`` where Keras defines the result by what
`tf.distribute.MirroredStrategy` does (per-replica batch statistics). ``TOLERANCES`` holds
the programs compared more loosely than 1e-5, with the reason (none today).

Result keys starting with ``per_rank_`` may differ between the ranks of one job (they
are compared with the reference on rank 0); ``uncompared_`` keys are reported only.
"""

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
SEED = 11
SHARED_FOLDER_ENV = "CONFORMANCE_SHARED_FOLDER"  # set by run.py: one folder for every rank of a job
PROGRAMS = {}
TOLERANCES = {}


def program(reference="plain"):
    def register(function):
        PROGRAMS[function.__name__] = (function, reference)
        return function

    return register


def rank():
    import os

    return int(os.environ.get("HOROVOD_RANK", "0"))


# -- shared pieces ---------------------------------------------------------------------

def regression(n=128, features=6, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    return x, (np.tanh(x @ w) + 0.05 * rng.normal(size=(n, outputs))).astype("float32")


def classification(n=128, features=6, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(features, classes)), axis=1).astype("int32")
    return x, y


def mlp(features=6, outputs=1, activation=None):
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(outputs, activation=activation)])


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def result(model, history=None, evaluate=None, predict=None, **extra):
    out = {"weights": [w.tolist() for w in model.get_weights()]}
    if history is not None:
        out["history"] = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    if evaluate is not None:
        out["evaluate"] = [float(v) for v in np.ravel(evaluate)] if not isinstance(evaluate, dict) else \
            {k: float(v) for k, v in evaluate.items()}
    if predict is not None:
        out["predict"] = np.asarray(predict).tolist()
    out.update(extra)
    return out


def build(make_strategy, model_fn=mlp, compile_kwargs=dict):
    """Build `model_fn()` under a fresh strategy, seeded, compiled with `compile_kwargs()`.

    `compile_kwargs` is called inside the scope: optimizers and metrics belong there.
    """
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = model_fn()
        model.compile(**({"optimizer": sgd(), "loss": "mse"} | compile_kwargs()))
    return model


def fit_mlp(make_strategy, x, y, compile_kwargs=dict, model_fn=mlp, **fit_kwargs):
    """`build`, then fit (x, y) at the global batch, unshuffled, for 2 epochs unless told otherwise."""
    model = build(make_strategy, model_fn, compile_kwargs)
    history = model.fit(x, y, verbose=0, **({"batch_size": GLOBAL_BATCH, "epochs": 2, "shuffle": False} | fit_kwargs))
    return model, history


# -- inputs ----------------------------------------------------------------------------

@program()
def numpy_arrays(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, validation_data=regression(64, seed=5))
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x[:45], batch_size=GLOBAL_BATCH, verbose=0))


@program()
def numpy_shuffled(make_strategy):
    keras.utils.set_random_seed(SEED)  # the seed Keras shuffles with, set before the strategy
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, shuffle=True, epochs=3)
    return result(model, history)


@program()
def uneven_last_batch(make_strategy):
    # 101 rows at batch 32: the last global batch has 5 rows, 2 on rank 0 and 3 on rank 1.
    x, y = regression(n=101)
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, sample_weight=weights)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def validation_split(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, validation_split=0.25)
    return result(model, history)


@program()
def dict_inputs(make_strategy):
    x, y = regression()
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="tanh")(a), b])
        model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(h))
        model.compile(sgd(), "mse")
    inputs = {"a": x[:, :4], "b": x[:, 4:]}
    history = model.fit(inputs, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, predict=model.predict(inputs, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def list_inputs(make_strategy):
    x, y = regression()
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        a, b = keras.Input((4,)), keras.Input((2,))
        h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="tanh")(a), b])
        model = keras.Model([a, b], keras.layers.Dense(1)(h))
        model.compile(sgd(), "mse")
    history = model.fit([x[:, :4], x[:, 4:]], y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program()
def multi_output_loss_weights(make_strategy):
    x, y = regression(outputs=2)
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        inp = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(inp)
        model = keras.Model(inp, {"first": keras.layers.Dense(1, name="first")(h),
                                  "second": keras.layers.Dense(1, name="second")(h)})
        model.compile(sgd(), loss={"first": "mse", "second": "mae"}, loss_weights={"first": 1.0, "second": 0.3},
                      metrics={"first": ["mae"]})
    targets = {"first": y[:, :1], "second": y[:, 1:]}
    history = model.fit(x, targets, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, targets, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True))


@program()
def sample_weight(make_strategy):
    x, y = regression()
    weights = np.linspace(0.1, 2.0, len(x)).astype("float32")
    model, history = fit_mlp(make_strategy, x, y, lambda: {"weighted_metrics": ["mae"]}, sample_weight=weights)
    return result(model, history)


@program()
def class_weight(make_strategy):
    x, y = classification()
    model, history = fit_mlp(
        make_strategy, x, y, lambda: {"loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]},
        model_fn=lambda: mlp(outputs=3, activation="softmax"), class_weight={0: 1.0, 1: 3.0, 2: 0.5})
    return result(model, history)


@program()
def tf_data_shuffle_prefetch(make_strategy):
    x, y = regression()
    ds = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=3)
          .batch(GLOBAL_BATCH).prefetch(tf.data.AUTOTUNE))
    model = build(make_strategy)
    history = model.fit(ds, epochs=3, verbose=0)
    return result(model, history)


@program()
def tf_data_repeat_steps_per_epoch(make_strategy):
    x, y = regression(n=96)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    model = build(make_strategy)
    history = model.fit(ds, epochs=3, steps_per_epoch=2, verbose=0)  # epochs run across the repeats
    return result(model, history)


@program()
def python_generator(make_strategy):
    x, y = regression(n=28 * GLOBAL_BATCH // 4)

    def batches():
        for i in range(0, len(x), GLOBAL_BATCH):
            yield x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]

    model = build(make_strategy)
    history = model.fit(batches(), epochs=1, verbose=0)
    # Not compared: one plain process counts 8 iterations for these 7 batches (Keras runs
    # the step once more when a generator ends; the counter moves, the weights do not).
    return result(model, history, uncompared_iterations=int(model.optimizer.iterations.numpy()))


class Rows(keras.utils.PyDataset):
    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // GLOBAL_BATCH)

    def __getitem__(self, i):
        return self.x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], self.y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]


def fit_py_dataset(make_strategy, **kwargs):
    x, y = regression(n=100)  # a last batch of 4 rows
    model = build(make_strategy)
    history = model.fit(Rows(x, y, **kwargs), epochs=2, verbose=0)
    return result(model, history)


@program()
def tf_data_filter_unknown_cardinality(make_strategy):
    # `filter` hides the length (cardinality UNKNOWN); 7 batches, an odd count for 2 workers.
    x, y = regression(n=7 * GLOBAL_BATCH)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda features, target: target[0] > -10).batch(GLOBAL_BATCH)
    model = build(make_strategy)
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history, model.evaluate(ds, verbose=0))


@program()
def string_inputs_string_lookup(make_strategy):
    # String tensors in the batch: the model looks words up itself (StringLookup + Embedding).
    words = np.array(["red", "green", "blue", "cyan", "pink"])
    rng = np.random.default_rng(4)
    text = words[rng.integers(0, len(words), size=(96, 2))]
    y = ((text[:, 0] == "red") | (text[:, 1] == "blue")).astype("float32")[:, None]
    ds = tf.data.Dataset.from_tensor_slices((tf.constant(text), y)).batch(GLOBAL_BATCH)

    def model_fn():
        inp = keras.Input((2,), dtype="string")
        ids = keras.layers.StringLookup(vocabulary=list(words))(inp)
        h = keras.layers.Flatten()(keras.layers.Embedding(len(words) + 1, 3)(ids))
        return keras.Model(inp, keras.layers.Dense(1)(h))

    model = build(make_strategy, model_fn)
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history, predict=model.predict(tf.constant(text[:40]), batch_size=16, verbose=0))

@program()
def py_dataset(make_strategy):
    return fit_py_dataset(make_strategy)


@program()
def py_dataset_two_workers(make_strategy):
    return fit_py_dataset(make_strategy, workers=2, use_multiprocessing=False)


@program()
def sparse_inputs(make_strategy):
    x, y = regression()
    x[np.abs(x) < 0.8] = 0.0  # mostly zeros
    ds = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(GLOBAL_BATCH)
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((6,), sparse=True), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]))
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history)


class RaggedMean(keras.Model):
    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(12, 4)
        self.out = keras.layers.Dense(1)

    def call(self, tokens):
        return self.out(tf.reduce_mean(self.embedding(tokens), axis=1))


@program()
def ragged_inputs(make_strategy):
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, 12, size=rng.integers(1, 6)).tolist() for _ in range(96)]
    y = np.array([[sum(r) / len(r) / 12.0] for r in rows], "float32")
    ds = tf.data.Dataset.from_tensor_slices((tf.ragged.constant(rows), y)).batch(GLOBAL_BATCH)
    model = build(make_strategy, RaggedMean)
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history)


@program()
def embedding_sparse_gradients(make_strategy, optimizer=lambda: keras.optimizers.Adam(0.01)):
    # Adam sees every duplicate row (Keras squares each): the rows travel unsummed.
    rng = np.random.default_rng(3)
    x = rng.integers(0, 500, size=(128, 3)).astype("int32")
    y = (x.sum(axis=1, keepdims=True) / 1500.0).astype("float32")
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((3,), dtype="int32"), keras.layers.Embedding(500, 4), keras.layers.Flatten(),
        keras.layers.Dense(1)]), lambda: {"optimizer": optimizer()})
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program()
def embedding_sparse_gradients_momentum_sgd(make_strategy):
    # SGD is linear in the gradient: duplicate rows are summed before they travel.
    return embedding_sparse_gradients(make_strategy, lambda: keras.optimizers.SGD(0.5, momentum=0.9))

@program()
def predict_and_evaluate_datasets(make_strategy):
    x, y = regression(n=100)
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae", keras.metrics.RootMeanSquaredError()]})
    predicted = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH), verbose=0)  # inputs only
    evaluated = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), verbose=0,
                               return_dict=True)
    return result(model, history, evaluated, predicted)


@program()
def tf_data_sample_weights_validation_freq(make_strategy):
    x, y = regression()
    weights = np.linspace(0.2, 1.8, len(x)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(GLOBAL_BATCH)
    validation = tf.data.Dataset.from_tensor_slices(regression(64, seed=5)).batch(GLOBAL_BATCH)
    model = build(make_strategy, compile_kwargs=lambda: {"weighted_metrics": ["mae"]})
    history = model.fit(ds, epochs=4, validation_data=validation, validation_freq=2, validation_steps=1, verbose=0)
    return result(model, history)



# -- models ----------------------------------------------------------------------------

class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


@program()
def subclassed_model(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, model_fn=Subclassed)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


class CustomSteps(keras.Model):
    """The pattern of Keras's guide "Customizing what happens in fit()"."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        logs = {m.name: m.result() for m in self.metrics}
        logs["constant"] = 10.0  # a Python number
        logs["numpy_value"] = np.float32(2.5)
        return logs

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return {"loss": loss, "constant": 5.0}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return {"prediction": self(x), "doubled": 2.0 * self(x)}


class TwoOptimizers(keras.Model):
    """The pattern of Keras's GAN guide: `compile` takes two optimizers, each updates its own part."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.body(x))

    def compile(self, body_optimizer, head_optimizer):
        super().compile()
        self.body_optimizer, self.head_optimizer = body_optimizer, head_optimizer
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        # tf.distribute's custom-loop rule: each replica divides its mean loss by the replicas,
        # whose gradients the strategy sums.
        replicas = self.distribute_strategy.num_replicas_in_sync
        for part, optimizer in ((self.head, self.head_optimizer), (self.body, self.body_optimizer)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
                scaled = loss / replicas
            grads = tape.gradient(scaled, part.trainable_weights)
            optimizer.apply(grads, part.trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


@program()
def two_optimizers_custom_step(make_strategy):
    x, y = regression()
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = TwoOptimizers()
        model.compile(keras.optimizers.SGD(0.02, momentum=0.9), keras.optimizers.Adam(0.01))
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, predict=model.predict(x[:8], batch_size=GLOBAL_BATCH, verbose=0))


@program(reference="tf-mirrored")
def custom_train_step(make_strategy):
    # The guide's step reports `compute_loss`, which Keras divides by the number of
    # replicas under any strategy: the logged loss is tf.distribute's, the weights match
    # one process (checked in `test_custom_steps_train_like_one_process`).
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, model_fn=CustomSteps)
    return result(model, history)


@program(reference="tf-mirrored")
def custom_test_step_dict(make_strategy):
    x, y = regression()
    model, _ = fit_mlp(make_strategy, x, y, model_fn=CustomSteps, epochs=1)
    return result(model, evaluate=model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True))


@program(reference="tf-mirrored")
def custom_test_step_flat(make_strategy):
    x, y = regression()
    model, _ = fit_mlp(make_strategy, x, y, model_fn=CustomSteps, epochs=1)
    return result(model, evaluate=model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))  # a flat list


@program()
def custom_predict_step(make_strategy):
    x, y = regression()
    model, _ = fit_mlp(make_strategy, x, y, model_fn=CustomSteps, epochs=1)
    out = model.predict(x[:50], batch_size=GLOBAL_BATCH, verbose=0)
    return result(model, predict=np.concatenate([out["prediction"], out["doubled"]], axis=1))


class PythonNumberMetric(keras.metrics.Metric):
    """A metric whose result is a Python number (it counts nothing)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        pass

    def result(self):
        return 3.0

    def reset_state(self):
        pass


@program()
def custom_metric_python_number(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae", PythonNumberMetric(name="three")]})
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True))


@program()
def batchnorm_synchronized(make_strategy):
    # No bias before BN: its true gradient is 0, and its values would be rounding noise.
    x, y = classification(features=6)
    model, history = fit_mlp(
        make_strategy, x, y, lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        model_fn=lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, use_bias=False),
                                           keras.layers.BatchNormalization(synchronized=True),
                                           keras.layers.ReLU(), keras.layers.Dense(3)]))
    return result(model, history)


@program(reference="tf-mirrored")
def batchnorm_per_replica(make_strategy):
    # Each replica normalises by its own batch and keeps its own moving statistics, as in
    # tf.distribute: those differ by rank (rank 0's are the ones saved).
    x, y = classification(features=6)
    model, history = fit_mlp(
        make_strategy, x, y, lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        model_fn=lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                           keras.layers.BatchNormalization(), keras.layers.ReLU(),
                                           keras.layers.Dense(3)]))
    out = result(model, history)
    out["weights"] = [w.numpy().tolist() for w in model.trainable_weights]
    out["per_rank_moving_statistics"] = [w.numpy().tolist() for w in model.non_trainable_weights]
    return out


@program()
def batchnorm_rank_without_rows(make_strategy):
    # One row per global batch: on 2 workers rank 0 gets none in every step. Its per-replica
    # batch statistics were a mean of nothing (NaN), which reached gamma's gradient on every rank;
    # rank 1 computes exactly what one process does, and rank 0 must add nothing.
    x, y = classification(n=1, features=6)
    model, history = fit_mlp(
        make_strategy, x, y, lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        model_fn=lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                           keras.layers.BatchNormalization(), keras.layers.ReLU(),
                                           keras.layers.Dense(3)]), epochs=3)
    out = result(model, history)
    out["weights"] = [w.numpy().tolist() for w in model.trainable_weights]
    # Rank 0's stay at their initial values (it saw no rows), finite; rank 1's follow one process.
    out["uncompared_moving_statistics"] = [w.numpy().tolist() for w in model.non_trainable_weights]
    out["per_rank_finite_moving_statistics"] = all(bool(np.isfinite(w.numpy()).all()) for w in model.non_trainable_weights)
    return out


class LayerState(keras.layers.Layer):
    """A layer's own state, updated in its training call: rows seen and a running sum over its
    inputs (aggregation="sum"), rows left of a budget (`assign_sub`), and its calls (the default
    aggregation: per worker, one per step)."""

    def build(self, shape):
        summed = {"trainable": False, "aggregation": "sum"}
        self.rows = self.add_weight(shape=(), initializer="zeros", name="rows", **summed)
        self.total = self.add_weight(shape=(shape[-1],), initializer="zeros", name="total", **summed)
        self.budget = self.add_weight(shape=(), initializer=keras.initializers.Constant(1000.0), name="budget",
                                      **summed)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x, training=False):
        if training:
            rows = keras.ops.cast(keras.ops.shape(x)[0], "float32")
            self.rows.assign_add(rows)
            self.total.assign_add(keras.ops.sum(keras.ops.round(4 * x), axis=0))  # exact in any order
            self.budget.assign_sub(rows)
            self.calls.assign_add(1.0)
        return x


@program()
def layer_state_summed_in_step(make_strategy):
    # Keras's assign_add is assign(self + value); under a strategy a "sum" variable summed every
    # worker's `self + value`, counting the old value once per worker each step (tf.distribute
    # still does: 8160 rows for 256).
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential(
        [keras.Input((6,)), LayerState(), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]))
    return result(model, history)


@program()
def lstm_sequences(make_strategy):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(96, 5, 3)).astype("float32")
    y = (x.sum(axis=(1, 2))[:, None] / 5).astype("float32")
    model = build(make_strategy, lambda: keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(8),
                                                            keras.layers.Dense(1)]))
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, predict=model.predict(x[:10], verbose=0))


@program()
def gru_masked_embedding(make_strategy):
    rng = np.random.default_rng(5)
    x = rng.integers(1, 20, size=(96, 7)).astype("int32")
    x[:, 5:] = 0  # padding, masked
    y = (x[:, :5].mean(axis=1, keepdims=True) / 20).astype("float32")
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((7,), dtype="int32"), keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.GRU(6),
        keras.layers.Dense(1)]))
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program()
def conv1d_text(make_strategy):
    rng = np.random.default_rng(6)
    x = rng.integers(0, 50, size=(96, 12)).astype("int32")
    y = (x % 2).mean(axis=1).round().astype("int32")
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8), keras.layers.Conv1D(8, 3, activation="relu"),
        keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(2)]),
        lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "metrics": ["accuracy"]})
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program()
def shared_layer_two_inputs(make_strategy):
    x, y = regression()
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        a, b = keras.Input((3,)), keras.Input((3,))
        shared = keras.layers.Dense(8, activation="tanh")
        model = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Add()([shared(a), shared(b)])))
        model.compile(sgd(), "mse")
    history = model.fit([x[:, :3], x[:, 3:]], y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


class ActivityLoss(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(h)))
        return h


@program()
def attention_block_adamw(make_strategy):
    # A transformer block: token embedding, self-attention, residual, layer norm, pooling.
    rng = np.random.default_rng(6)
    tokens = rng.integers(1, 40, size=(96, 10)).astype("int32")
    y = (tokens[:, :3].sum(axis=1) % 2).astype("int32")

    def model_fn():
        inp = keras.Input((10,), dtype="int32")
        h = keras.layers.Embedding(40, 8)(inp)
        # No biases in the attention: the key's gets a gradient of 0 up to rounding (softmax does not
        # see a shift of every logit), too small a tensor to compare relatively.
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 4, use_bias=False)(h, h))
        return keras.Model(inp, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h)))

    model, history = fit_mlp(make_strategy, tokens, y, lambda: {
        "optimizer": keras.optimizers.AdamW(0.005, weight_decay=0.01),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "metrics": ["accuracy"]},
        model_fn=model_fn)
    return result(model, history)

@program()
def regularizer_and_layer_losses(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)),
        ActivityLoss(), keras.layers.Dense(1)]))
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def normalization_adapted_in_scope(make_strategy):
    x, y = regression()
    x = x * 3 + 1
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        norm = keras.layers.Normalization()
        norm.adapt(x)
        model = keras.Sequential([keras.Input((6,)), norm, keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(sgd(), "mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program()
def saved_model_loaded_in_scope(make_strategy):
    import tempfile

    x, y = regression()
    keras.utils.set_random_seed(SEED)
    pretrained = mlp()  # built and saved without any strategy, as another script would
    with tempfile.TemporaryDirectory() as folder:
        pretrained.save(f"{folder}/pretrained.keras")
        strategy = make_strategy()
        with strategy.scope():
            model = keras.models.load_model(f"{folder}/pretrained.keras")
            model.compile(sgd(), "mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


def log_cosh(y_true, y_pred):
    return keras.ops.mean(keras.ops.log(keras.ops.cosh(y_true - y_pred)), axis=-1)


@program()
def custom_loss_function(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"loss": log_cosh})
    return result(model, history)


class OwnLoss(keras.Model):
    """`compute_loss` overridden as in Keras's own docstring: plain ops and `self.losses`, not
    divided by the workers, with a loss tracker of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="own_loss")

    def compute_loss(self, x, y, y_pred, sample_weight, training=True):
        loss = keras.ops.mean((y_pred - y) ** 2)
        loss += keras.ops.sum(self.losses)
        self.loss_tracker.update_state(loss)
        return loss


class SuperLossPlusPenalty(keras.Model):
    """`compute_loss` overridden on top of Keras's (which divides by the workers itself)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training) + 0.1 * keras.ops.mean(keras.ops.abs(y_pred))


def functional(model_class):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    return model_class(inputs, keras.layers.Dense(1)(hidden))


@program()
def compute_loss_overridden(make_strategy):
    # Its gradients and logged loss were twice one process's on 2 workers (tf.distribute's still are).
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: functional(OwnLoss), validation_data=regression(64, seed=5))
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True))


@program()
def compute_loss_calls_super(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]},
                             model_fn=lambda: functional(SuperLossPlusPenalty))
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def auc_precision_recall(make_strategy):
    x, y = classification(classes=2)
    model, history = fit_mlp(make_strategy, x, y.astype("float32"), lambda: {
        "loss": "binary_crossentropy",
        "metrics": [keras.metrics.AUC(), keras.metrics.Precision(), keras.metrics.Recall(), "accuracy"]},
        model_fn=lambda: mlp(activation="sigmoid"), validation_data=classification(64, classes=2, seed=7))
    return result(model, history)



# -- optimizers and steps --------------------------------------------------------------

@program()
def adam_global_clipnorm(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.Adam(0.01, global_clipnorm=0.1)})
    return result(model, history)


@program()
def nesterov_clipnorm(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, clipnorm=0.05)})
    return result(model, history)


@program()
def gradient_accumulation(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2)})
    return result(model, history, iterations=int(model.optimizer.iterations.numpy()))


@program()
def loss_scale_optimizer(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 8)})
    return result(model, history)


@program()
def loss_scale_overflow_in_some_rows(make_strategy):
    # The second global batch of each epoch has 16 huge rows (on 2 workers: all of rank 1's):
    # the scaled loss overflows there, so the loss-scaling optimizer skips that step and halves
    # its scale. One process sees the whole batch; every worker must skip with it.
    x, y = regression()
    x[GLOBAL_BATCH + GLOBAL_BATCH // 2:2 * GLOBAL_BATCH] *= 1e5
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0 ** 100)},
        model_fn=lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)]))  # linear: no saturation
    return result(model, history, loss_scale=float(model.optimizer.dynamic_scale.numpy()),
                  iterations=int(model.optimizer.iterations.numpy()))


@program()
def steps_per_execution(make_strategy):
    x, y = regression(n=160)
    model, history = fit_mlp(make_strategy, x, y, lambda: {"steps_per_execution": 3, "metrics": ["mae"]})
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def on_batch_methods(make_strategy):
    x, y = regression(n=GLOBAL_BATCH)
    model = build(make_strategy)
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    return result(model, test_on_batch=float(model.test_on_batch(x, y)), train_losses=losses,
                  predict=model.predict_on_batch(x[:8]))

@program()
def adamw_lr_schedule(make_strategy):
    x, y = regression()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5)
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "optimizer": keras.optimizers.AdamW(schedule, weight_decay=0.1)}, epochs=3)
    return result(model, history)


@program()
def multi_optimizer(make_strategy):
    # keras.optimizers.MultiOptimizer: Adam for the first layer, momentum SGD for the rest,
    # chosen by a callable (found by a probe of every Keras optimizer; zero1 refuses it by name).
    x, y = regression()

    def optimizers():
        adam, momentum_sgd = keras.optimizers.Adam(0.01), sgd()
        return {"optimizer": keras.optimizers.MultiOptimizer(
            lambda variable: adam if "first" in variable.path else momentum_sgd)}

    def model_fn():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh", name="first"),
                                 keras.layers.Dense(1)])

    model, history = fit_mlp(make_strategy, x, y, optimizers, model_fn=model_fn)
    return result(model, history)


@program()
def multi_optimizer_made_outside_scope(make_strategy):
    # The MultiOptimizer and its sub-optimizers made before the strategy, as a one-process script
    # makes them; tfdp takes them over at compile and at build (they failed in TensorFlow before:
    # "Mixing different tf.distribute.Strategy objects").
    x, y = regression()
    adam, momentum_sgd = keras.optimizers.Adam(0.01), sgd()
    optimizer = keras.optimizers.MultiOptimizer(lambda variable: adam if "first" in variable.path else momentum_sgd)
    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh", name="first"),
                                  keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history)


@program(reference="tf-mirrored")
def schedule_free_adamw(make_strategy):
    # ScheduleFreeAdamW copies the weights into its momentum when built. Plain Keras (one
    # process, no strategy) loses that copy and zeroes the weights at the first step (a Keras
    # bug, seen in 3.15.1), so the reference is tf.distribute's, which keeps it, as tfdp does.
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"optimizer": keras.optimizers.ScheduleFreeAdamW(0.01)})
    return result(model, history, evaluate=model.evaluate(x, y, verbose=0))


@program()
def jit_compile_requested(make_strategy):
    # One process compiles the step with XLA; tfdp falls back to no XLA (warned on rank 0).
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"jit_compile": True, "metrics": ["mae"]})
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x[:45], batch_size=GLOBAL_BATCH, verbose=0))

@program()
def ema_weights(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"optimizer": keras.optimizers.SGD(
        0.05, momentum=0.9, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)})
    return result(model, history)


@program()
def clipvalue(make_strategy):
    # tf.distribute clips each replica's gradient before summing (1.0 relative from one
    # process here); tfdp clips the summed one, as one process does.
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"optimizer": keras.optimizers.SGD(0.05, clipvalue=0.01)})
    return result(model, history)


@program()
def run_eagerly(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"run_eagerly": True, "metrics": ["mae"]})
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def freeze_and_recompile_outside_scope(make_strategy):
    # Keras's transfer-learning pattern: freeze, compile again (outside the scope), fit again.
    x, y = regression()
    model, _ = fit_mlp(make_strategy, x, y, epochs=1)
    model.layers[0].trainable = False
    model.compile("adam", "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  iterations=int(model.optimizer.iterations.numpy()))


# On 3 workers (11/11/10 rows) its output bias, a scalar near -0.00115, ends 1.4e-8 from one
# process: 1.24e-5 of itself (every other tensor within 7.4e-7, logs within 2e-7). Rounding,
# which Adam's per-entry scaling carries to a tensor 500 times smaller than the weights.
TOLERANCES["fine_tune_with_optimizer_made_outside_scope"] = 3e-5


@program()
def fine_tune_with_optimizer_made_outside_scope(make_strategy):
    # Keras's transfer-learning guide: a frozen base, then unfreeze and compile again with
    # `keras.optimizers.Adam(1e-5)` written outside any scope (tf.distribute raises; tfdp refused it).
    x, y = regression()
    model, _ = fit_mlp(make_strategy, x, y, epochs=1)
    model.layers[0].trainable = False
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    model.layers[0].trainable = True
    model.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  iterations=int(model.optimizer.iterations.numpy()))


@program()
def fit_again_from_initial_epoch(make_strategy):
    x, y = regression()
    model, first = fit_mlp(make_strategy, x, y, epochs=1)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, initial_epoch=1, epochs=3, shuffle=False, verbose=0)
    return result(model, history, first=first.history["loss"], iterations=int(model.optimizer.iterations.numpy()))



# -- callbacks -------------------------------------------------------------------------

class StopAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


@program()
def batch_callback_stops_training(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, epochs=3, callbacks=[StopAtBatch(2)])
    return result(model, history, iterations=int(model.optimizer.iterations.numpy()))


@program()
def epoch_callbacks(make_strategy):
    x, y = regression()
    callbacks = [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
                 keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)]
    model, history = fit_mlp(make_strategy, x, y, epochs=5, callbacks=callbacks)
    return result(model, history, learning_rate=float(model.optimizer.learning_rate.numpy()))


@program()
def early_stopping_restores_best_weights(make_strategy):
    # The best epoch by val_loss is restored when training stops (a large learning rate makes
    # the last epochs worse); Keras keeps the weights in the callback, not in the model.
    x, y = regression()
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    model, history = fit_mlp(make_strategy, x, y, lambda: {"optimizer": keras.optimizers.SGD(0.4, momentum=0.9)},
                             epochs=8, validation_data=regression(64, seed=5), callbacks=[stop])
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  best_epoch=int(stop.best_epoch))


# -- more of what ordinary scripts do (stop 44) ------------------------------------------

@program()
def lr_callbacks(make_strategy):
    # ReduceLROnPlateau reads the epoch's loss (a global number under tfdp, so every rank cuts the
    # rate at the same epoch); LearningRateScheduler sets it each epoch before that.
    x, y = regression()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9 if epoch else lr)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.05, min_lr=1e-4)
    model, history = fit_mlp(make_strategy, x, y, epochs=5, callbacks=[schedule, plateau])
    return result(model, history, learning_rate=float(np.asarray(model.optimizer.learning_rate)))


@program()
def weighted_validation_with_its_own_batch_size(make_strategy):
    # Validation rows weighted, at another batch size than training's (24 rows: 16 + 8).
    x, y = regression()
    xv, yv = regression(24, seed=5)
    model, history = fit_mlp(make_strategy, x, y, lambda: {"weighted_metrics": ["mae"], "metrics": ["mse"]},
                             sample_weight=np.linspace(0.5, 1.5, len(x)).astype("float32"),
                             validation_data=(xv, yv, np.linspace(2.0, 0.1, len(xv)).astype("float32")),
                             validation_batch_size=16)
    return result(model, history)


class Reconstruction(keras.layers.Layer):
    """An autoencoder's loss added by a layer: the model is fit on inputs alone."""

    def call(self, pair):
        inputs, decoded = pair
        self.add_loss(keras.ops.mean(keras.ops.square(inputs - decoded)))
        return decoded


@program()
def autoencoder_on_inputs_alone(make_strategy):
    x, _ = regression()

    def autoencoder():
        inp = keras.Input((6,))
        code = keras.layers.Dense(3, activation="tanh")(inp)
        return keras.Model(inp, Reconstruction()([inp, keras.layers.Dense(6)(code)]))

    model = build(make_strategy, autoencoder, lambda: {"loss": None})
    data = tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH)
    history = model.fit(data, epochs=2, verbose=0)
    return result(model, history, evaluate=model.evaluate(data, verbose=0), predict=model.predict(data, verbose=0))


@program()
def evaluate_and_predict_for_some_steps(make_strategy):
    # evaluate(steps=) on a repeated dataset, predict on a Python generator of inputs.
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]})
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()

    def inputs():
        for i in range(0, 80, 20):  # 4 batches of 20 rows
            yield (x[i:i + 20],)

    return result(model, history, evaluate=model.evaluate(repeated, steps=3, verbose=0),
                  predict=model.predict(inputs(), verbose=0))


@program()
def time_distributed_and_lambda(make_strategy):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(96, 5, 4)).astype("float32")
    y = np.tanh(x.sum(axis=(1, 2)) / 4)[:, None].astype("float32")
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential([
        keras.Input((5, 4)), keras.layers.TimeDistributed(keras.layers.Dense(8, activation="tanh")),
        keras.layers.Lambda(lambda t: t * 2.0), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)]))
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def nested_outputs_with_metrics_per_output(make_strategy):
    x, y = classification()
    y_reg = regression(seed=3)[1]

    def two_heads():
        inp = keras.Input((6,))
        h = keras.layers.Dense(12, activation="relu")(inp)
        return keras.Model(inp, {"label": keras.layers.Dense(3, name="label")(h),
                                 "value": keras.layers.Dense(1, name="value")(h)})

    model = build(make_strategy, two_heads, lambda: {
        "optimizer": keras.optimizers.Adam(0.01),
        "loss": {"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "value": "mse"},
        "metrics": {"label": ["sparse_categorical_accuracy"], "value": ["mae"]}})
    targets = {"label": y, "value": y_reg}
    history = model.fit(x, targets, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, targets, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True))


# bfloat16 rounds each worker's half batch on its own, as float16 does (see mixed_precision).
@program("tf-mirrored")
def mixed_bfloat16(make_strategy):
    x, y = regression()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model, history = fit_mlp(make_strategy, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return result(model, history)


# -- losses normalized by what each rank holds (stop 45) ---------------------------------
# Keras divides a masked loss by its valid entries, and a "mean_with_sample_weight" loss by its
# weights' sum, per replica; tf.distribute keeps that (its result differs from one process on
# these programs), tfdp divides by the count over all ranks. Each has a last, uneven batch.

def padded_sequences(n=99, steps=7, vocabulary=12, classes=3, seed=5):
    """Token ids padded with 0 to `steps` (lengths 1..steps), and a class per token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, steps + 1, size=n)
    x = rng.integers(1, vocabulary, size=(n, steps)) * (np.arange(steps) < lengths[:, None])
    return x.astype("int32"), (x % classes).astype("int32")


@program()
def masked_sequence_loss(make_strategy):
    x, y = padded_sequences()
    model, history = fit_mlp(make_strategy, x, y, lambda: {
        "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}, model_fn=lambda: keras.Sequential([
            keras.Input((7,), dtype="int32"), keras.layers.Embedding(12, 4, mask_zero=True),
            keras.layers.LSTM(4, return_sequences=True), keras.layers.Dense(3, activation="softmax")]))
    return result(model, history, evaluate=model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def ignore_class_loss(make_strategy):
    x, y = classification(n=99, classes=4)
    y[np.arange(99) % 3 == 0] = 3
    y[:24] = 3  # the first batch's first half holds few labels that count
    model, history = fit_mlp(make_strategy, x, y, lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=3)}, model_fn=lambda: mlp(outputs=4))
    return result(model, history, evaluate=model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def mean_with_sample_weight_loss(make_strategy):
    x, y = regression(n=99)
    weights = np.where(np.arange(99) % 32 < 12, 3.0, 0.5).astype("float32")
    model, history = fit_mlp(make_strategy, x, y, lambda: {"loss": keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight")}, sample_weight=weights)
    return result(model, history, evaluate=model.evaluate(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH,
                                                          verbose=0))


# -- layers and shapes (stop 45) ---------------------------------------------------------

@program()
def bidirectional_lstm(make_strategy):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 5, 3)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None].astype("float32")
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential([
        keras.Input((5, 3)), keras.layers.Bidirectional(keras.layers.LSTM(4)), keras.layers.Dense(1)]))
    return result(model, history, predict=model.predict(x[:10], verbose=0))


@program()
def conv_transpose_autoencoder(make_strategy):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
    model, history = fit_mlp(make_strategy, x, x, model_fn=lambda: keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.UpSampling2D(),
        keras.layers.Conv2DTranspose(1, 3, strides=2, padding="same")]))
    return result(model, history)


@program()
def input_with_a_fixed_batch_size(make_strategy):
    # keras.Input(batch_size=32) names the global batch; each worker's step sees its 16 rows.
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential([
        keras.Input((6,), batch_size=GLOBAL_BATCH), keras.layers.Dense(4), keras.layers.Dense(1)]))
    return result(model, history)


@program()
def steps_per_epoch_on_arrays(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, steps_per_epoch=3, epochs=3)
    return result(model, history)


class RunningInputMean(keras.layers.Layer):
    """An exponential moving average of its inputs' batch mean, updated in its training call,
    with aggregation="mean" (every worker's update averaged, as in one process when the rows
    split evenly)."""

    def build(self, shape):
        self.ema = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False, name="ema",
                                   aggregation="mean")

    def call(self, x, training=False):
        if training:
            self.ema.assign(0.9 * self.ema + 0.1 * keras.ops.mean(x, axis=0))
        return x - self.ema


@program()
def layer_state_mean_in_step(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential(
        [keras.Input((6,)), RunningInputMean(), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]))
    return result(model, history)


@program()
def py_dataset_multiprocessing(make_strategy):
    # Keras's own process pool makes the batches (forked after Horovod started its threads).
    return fit_py_dataset(make_strategy, workers=2, use_multiprocessing=True)


@program()
def tensor_inputs(make_strategy):
    # tf.Tensor inputs instead of NumPy arrays, for fit, evaluate and predict.
    x, y = regression(n=100)
    model = build(make_strategy)
    history = model.fit(tf.constant(x), tf.constant(y), batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(tf.constant(x), tf.constant(y), batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(tf.constant(x[:40]), batch_size=16, verbose=0))


@program()
def fits_with_other_batch_sizes(make_strategy):
    # One model, fit at one global batch, then at another, then evaluated at a third.
    x, y = regression(n=96)
    model = build(make_strategy)
    first = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    second = model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    return result(model, second, model.evaluate(x, y, batch_size=48, verbose=0),
                  first_history=first.history["loss"])


@program()
def add_loss_without_compiled_loss(make_strategy):
    # compile() without a loss: the only loss is the one a layer adds (here, a regression loss
    # the model computes itself from its target input).
    x, y = regression()

    def model_fn():
        features, target = keras.Input((6,)), keras.Input((1,))
        prediction = mlp()(features)

        class SquaredError(keras.layers.Layer):
            def call(self, prediction, target):
                self.add_loss(keras.ops.mean(keras.ops.square(prediction - target)))
                return prediction

        return keras.Model([features, target], SquaredError()(prediction, target))

    strategy = make_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = model_fn()
        model.compile(sgd())
    history = model.fit([x, y], batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate([x, y], batch_size=GLOBAL_BATCH, verbose=0))


@program()
def stateful_lstm(make_strategy):
    # A stateful LSTM (Keras's RNN guide): its state carries from one batch to the next, row by
    # row, and is reset when an epoch begins. Each worker keeps the state of its own rows.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(96, 4, 2)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None].astype("float32") / 4

    def model_fn():
        return keras.Sequential([keras.Input((4, 2), batch_size=GLOBAL_BATCH), keras.layers.LSTM(5, stateful=True),
                                 keras.layers.Dense(1)])

    model = build(make_strategy, model_fn)
    reset = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: model.layers[0].reset_state())
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[reset])
    evaluated = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)  # continues from training's state
    model.layers[0].reset_state()
    return result(model, history, evaluated, model.predict(x, batch_size=GLOBAL_BATCH, verbose=0))


class CenteredMlp(keras.Model):
    """A subclassed model that subtracts a stored float32 offset from its inputs itself."""

    def __init__(self):
        super().__init__()
        self.offset = self.add_weight(shape=(6,), initializer="zeros", trainable=False, name="offset")
        self.hidden, self.out = keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs - self.offset))


@program()
def float64_arrays_and_uint8_labels(make_strategy):
    # NumPy's default dtype (and scikit-learn's loaders'): float64 features and sample weights,
    # uint8 labels. Keras casts floats to float32 before the model sees them.
    x, y = classification()
    x, y = x.astype("float64"), y.astype("uint8")
    weights = np.linspace(0.5, 1.5, len(x))  # float64
    model = build(make_strategy, CenteredMlp, lambda: {"optimizer": keras.optimizers.SGD(0.05),
                                                       "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                                       "weighted_metrics": ["accuracy"]})
    history = model.fit(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x[:40], batch_size=16, verbose=0))


@program()
def scipy_sparse_inputs(make_strategy):
    # A SciPy CSR matrix, as scikit-learn's text vectorizers return (Keras makes tf.SparseTensors).
    import scipy.sparse

    rng = np.random.default_rng(8)
    x = scipy.sparse.random(100, 20, density=0.2, format="csr", random_state=8, dtype=np.float32)
    y = (x @ rng.normal(size=(20, 1))).astype("float32")
    model = build(make_strategy, lambda: keras.Sequential([keras.Input((20,), sparse=True), keras.layers.Dense(8),
                                                           keras.layers.Dense(1)]))
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                  model.predict(x[:40], batch_size=16, verbose=0))


@program()
def padded_batch_variable_lengths(make_strategy):
    # Sequences of varying length, padded per batch by tf.data: each step's length differs.
    rng = np.random.default_rng(9)
    lengths = rng.integers(2, 12, size=100)
    sequences = [rng.integers(1, 20, size=n) for n in lengths]
    labels = np.array([s.sum() % 2 for s in sequences], "float32")
    ds = tf.data.Dataset.from_generator(lambda: zip(sequences, labels), output_signature=(
        tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.float32))).padded_batch(GLOBAL_BATCH)
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((None,), dtype="int64"), keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.GRU(5),
        keras.layers.Dense(1, activation="sigmoid")]),
        lambda: {"optimizer": sgd(), "loss": "binary_crossentropy", "metrics": ["accuracy"]})
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history, model.evaluate(ds, verbose=0))


@program()
def timeseries_windows(make_strategy):
    # keras.utils.timeseries_dataset_from_array, shuffled with a seed: windows of a series.
    series = np.sin(np.arange(300) / 7.0).astype("float32")[:, None]
    ds = keras.utils.timeseries_dataset_from_array(series[:-8], series[8:], sequence_length=8, batch_size=GLOBAL_BATCH,
                                                   shuffle=True, seed=4)
    model = build(make_strategy, lambda: keras.Sequential([keras.Input((8, 1)), keras.layers.Conv1D(4, 3),
                                                           keras.layers.Flatten(), keras.layers.Dense(1)]))
    history = model.fit(ds, epochs=2, verbose=0)
    return result(model, history)


@program()
def validation_from_a_generator(make_strategy):
    # validation_data as a Python generator, read validation_steps batches at each epoch's end.
    x, y = regression()

    def validation():
        while True:
            for i in range(0, 64, GLOBAL_BATCH):
                yield x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]

    model, history = fit_mlp(make_strategy, x, y, validation_data=validation(), validation_steps=2)
    return result(model, history)


@program()
def image_files_from_a_directory(make_strategy):
    # keras.utils.image_dataset_from_directory over PNG files (seeded shuffle), rescaled in the model.
    import os
    import shutil
    import tempfile

    from sklearn.datasets import load_digits

    digits = load_digits()
    folder = tempfile.mkdtemp(prefix="conformance-images-")
    for i, (image, label) in enumerate(zip(digits.images[:96], digits.target[:96])):
        os.makedirs(os.path.join(folder, str(label)), exist_ok=True)
        png = tf.io.encode_png(tf.constant((image * 15).astype("uint8")[:, :, None]))
        tf.io.write_file(os.path.join(folder, str(label), f"{i}.png"), png)
    ds = keras.utils.image_dataset_from_directory(folder, color_mode="grayscale", image_size=(8, 8),
                                                  batch_size=GLOBAL_BATCH, seed=5)
    model = build(make_strategy, lambda: keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Rescaling(1 / 255), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(10)]),
        lambda: {"optimizer": sgd(), "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)})
    history = model.fit(ds, epochs=2, verbose=0)
    evaluated = model.evaluate(ds, verbose=0)
    shutil.rmtree(folder)
    return result(model, history, evaluated)


# Random layers draw per replica, as under tf.distribute (one process draws for the whole batch).
@program("tf-mirrored")
def dropout_and_gaussian_noise(make_strategy):
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, model_fn=lambda: keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.3),
        keras.layers.GaussianNoise(0.1), keras.layers.Dense(1)]))
    return result(model, history, evaluate=model.evaluate(x, y, verbose=0))


# -- set-up ----------------------------------------------------------------------------

# float16 rounds each worker's half-batch forward and backward pass on its own: against one
# process that measured 1.2e-3 relative on an AVX512-FP16 CPU (earlier machines stayed under
# 1e-3). tf.distribute's two replicas round exactly as tfdp's two workers do (measured 0.0).
@program("tf-mirrored")
def mixed_precision(make_strategy):
    x, y = regression()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, history = fit_mlp(make_strategy, x, y)  # Keras wraps SGD in a LossScaleOptimizer
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return result(model, history, uncompared_optimizer=type(model.optimizer).__name__)


@program()
def checkpoints_and_logs_on_rank_0(make_strategy):
    """ModelCheckpoint, TensorBoard, BackupAndRestore, model.save, model.export and tf.saved_model.save
    write on rank 0 only."""
    import os
    import shutil
    import tempfile

    x, y = regression()
    folder = tempfile.mkdtemp(prefix=f"tfdp-conformance-rank{rank()}-")
    callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(folder, "ckpt-{epoch}.keras")),
                 keras.callbacks.TensorBoard(os.path.join(folder, "tb")),
                 keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"), delete_checkpoint=False)]
    try:
        model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]}, epochs=3, callbacks=callbacks)
        if rank() == 0:  # the Horovod idiom: only rank 0 saves, the others go on (no collective in save)
            model.save(os.path.join(folder, "model.keras"))
        model.export(os.path.join(folder, "exported"), verbose=False)  # an unchanged script: on every rank
        tf.saved_model.save(model, os.path.join(folder, "saved"))
        written = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    written = [name.split("/events.out")[0] if "events.out" in name else name for name in written]
    return result(model, history, per_rank_files_written=len(written),
                  per_rank_checkpoints=len([n for n in written if n.startswith("ckpt-")]))


@program()
def best_checkpoint_loaded_on_every_rank(make_strategy):
    """The best checkpoint ModelCheckpoint wrote, loaded back on every rank as soon as fit returns."""
    import os
    import time

    class SlowDisk(keras.callbacks.Callback):  # rank 0's last write lands 1 s late (a network filesystem)
        def on_epoch_end(self, epoch, logs=None):
            if rank() == 0 and epoch == self.params["epochs"] - 1:
                time.sleep(1.0)

    x, y = regression()
    path = os.path.join(os.environ.get(SHARED_FOLDER_ENV, "."), "best.keras")
    best = keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True)
    model, history = fit_mlp(make_strategy, x, y, epochs=3, callbacks=[SlowDisk(), best])
    loaded = keras.models.load_model(path)  # on rank 1, before rank 0 has written it, unless fit waits
    return result(model, history, best_weights=[w.tolist() for w in loaded.get_weights()])


@program()
def seed_before_strategy(make_strategy):
    keras.utils.set_random_seed(SEED)
    strategy = make_strategy()
    x, y = regression()
    with strategy.scope():
        model = mlp()  # initial weights drawn from the seed set before the strategy
        model.compile(sgd(), "mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=True, verbose=0)
    return result(model, history)


@program()
def seed_after_strategy(make_strategy):
    strategy = make_strategy()
    keras.utils.set_random_seed(SEED)
    x, y = regression()
    with strategy.scope():
        model = mlp()
        model.compile(sgd(), "mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=True, verbose=0)
    return result(model, history)


@program()
def extra_model_on_rank_0(make_strategy):
    x, y = regression()
    if rank() == 0:  # a reference, an exporter, a teacher: built and trained on rank 0 only
        teacher = mlp()
        teacher.compile("sgd", "mse")
        teacher.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    model, history = fit_mlp(make_strategy, x, y, lambda: {"metrics": ["mae"]})
    return result(model, history, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))


@program()
def worker_output(make_strategy):
    """Silenced ranks print again when allowed, and building strategies leaks no file handle."""
    import os
    import sys

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        make_strategy()
    after = len(os.listdir("/proc/self/fd"))
    print(f"silenced-unless-chief from rank {rank()}", flush=True)
    if hasattr(sys.stdout, "rank"):  # tfdp's stdout: let every rank print, then silence again
        import tfdp

        tfdp.set_worker_stdout(True)
        print(f"allowed from rank {rank()}", flush=True)
        tfdp.set_worker_stdout(False)
    else:
        print(f"allowed from rank {rank()}", flush=True)
    x, y = regression()
    model, history = fit_mlp(make_strategy, x, y, epochs=1)
    return result(model, history, file_handles_added=after - before)


@program()
def op_determinism(make_strategy):
    # Last: determinism cannot be switched off again in this process.
    tf.config.experimental.enable_op_determinism()
    strategy = make_strategy()  # no global seed yet
    x, y = regression()
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = mlp()
        model.compile(sgd(), "mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=True, verbose=0)
    return result(model, history)
