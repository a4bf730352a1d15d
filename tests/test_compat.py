"""Keras still calls every hook tfdp installs: spies count the calls of an ordinary program.

If a Keras upgrade moves one of these functions, or stops calling it, its count is 0 and
this test names it. The spies wrap whatever is installed (tfdp's hook), so they count what
Keras calls, not what tfdp set.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp._compat import keras as keras_hooks


def spy_on(functions, counts):
    originals = []
    for owner, name in functions:
        current = getattr(owner, name)

        @functools.wraps(current)
        def spy(*args, __current=current, __key=(owner, name), **kwargs):
            counts[__key] += 1
            return __current(*args, **kwargs)

        counts[(owner, name)] = 0
        originals.append((owner, name, current))
        setattr(owner, name, spy)
    return originals


class RowCounter(keras.layers.Layer):
    """Counts the rows it trains on, up and down (a layer's own state, summed over workers)."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="sum")
        self.left = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="sum")

    def call(self, x, training=False):
        if training:
            rows = keras.ops.cast(keras.ops.shape(x)[0], "float32")
            self.seen.assign_add(rows)
            self.left.assign_sub(rows)
        return x


def ordinary_program(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = tfdp.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), RowCounter(), keras.layers.Dense(8),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, clipnorm=1.0), loss="mse")
        scaled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        scaled.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        split = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        adam, sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.01)
        split.compile(optimizer=keras.optimizers.MultiOptimizer(lambda v: adam if v.shape[-1] == 3 else sgd),
                      loss="mse")
        recurrent = keras.Sequential([keras.Input((4, 1), batch_size=16), keras.layers.LSTM(2, stateful=True)])
        recurrent.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    recurrent.fit(x[..., None], y, batch_size=16, epochs=1, verbose=0)
    scaled.fit(x, y, batch_size=16, epochs=1, verbose=0)
    split.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    model.train_on_batch(x[:16], y[:16])
    model.test_on_batch(x[:16], y[:16])
    model.predict_on_batch(x[:16])
    model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).cache().batch(16), verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    model.export(tmp_path / "exported", verbose=False)
    tf.saved_model.save(model, str(tmp_path / "saved"))


def test_keras_calls_every_hook(tmp_path):
    tfdp._compat.install()
    hooked = keras_hooks.hooked_functions()
    counts = {}
    # Negative control: a Keras method this program never calls stays at 0.
    unused = (keras.Model, "to_json")
    originals = spy_on(hooked + [unused], counts)
    try:
        ordinary_program(tmp_path)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    missing = [f"{owner.__name__}.{name}" for (owner, name), n in counts.items() if n == 0 and (owner, name) != unused]
    assert not missing, f"Keras no longer calls these tfdp hooks: {missing}"
    assert counts[unused] == 0


def test_install_is_idempotent():
    tfdp._compat.install()
    before = [getattr(owner, name) for owner, name in keras_hooks.hooked_functions()]
    tfdp._compat.install()
    assert before == [getattr(owner, name) for owner, name in keras_hooks.hooked_functions()]


def recorded(method, name, calls):
    @functools.wraps(method)
    def record(*args, **kwargs):
        calls.append(name)
        return method(*args, **kwargs)

    return record


def test_the_reducer_hears_of_an_update_before_it_reduces_under_loss_scaling():
    # Under a LossScaleOptimizer the reduction runs in its `apply`, before the inner optimizer's
    # update: reducers that keep state per update (local SGD's counters, the optimizer stale
    # gradients settle with) must hear of the update first, once (local SGD failed at trace).
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = tfdp.MirroredStrategy()
    reducer, calls = strategy.gradient_reducer, []
    for name in ("before_update", "reduce", "after_update"):
        setattr(reducer, name, recorded(getattr(reducer, name), name, calls))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert calls[:3] == ["before_update", "reduce", "after_update"]
    assert calls.count("before_update") == calls.count("after_update") >= 1


def test_a_model_never_compiled_predicts_under_tfdp():
    # Keras's own trainer tests predict with models never compiled (no `optimizer` attribute at
    # all); tfdp settles before inference and must not need one.
    strategy = tfdp.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    x = np.ones((8, 4), "float32")
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), model(x).numpy(), rtol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x), model(x).numpy(), rtol=1e-6)


def test_a_multi_optimizers_checkpoint_under_a_compressed_preset_loads_back(tmp_path):
    # The sub-optimizers, made in the scope, each carried the reducer's state too; loading it
    # through them handed the per-rank optimizer state to their variables by position, and Keras
    # refused the file ("2 objects could not be loaded"). The MultiOptimizer now carries it once.
    x = np.random.default_rng(0).normal(size=(32, 8, 8, 1)).astype("float32")
    y = (x.sum(axis=(1, 2, 3)) > 0).astype("int32")
    strategy = tfdp.strategy("topk-1pct")

    def build():
        with strategy.scope():
            adam, sgd = keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.05, momentum=0.9)
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(),
                                      keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.MultiOptimizer(lambda v: adam if "conv2d" in v.path else sgd),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model

    trained = build()
    trained.fit(x, y, batch_size=16, epochs=1, verbose=0)
    trained.save_weights(tmp_path / "m.weights.h5")
    restored = build()
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(tmp_path / "m.weights.h5")
    saved = [v.numpy() for v in trained.optimizer.variables]
    assert len(saved) == 12  # the MultiOptimizer's 2, Adam's 6 and momentum SGD's 4
    for before, after in zip(saved, restored.optimizer.variables):
        np.testing.assert_array_equal(before, after.numpy())
    assert not any(hasattr(sub, keras_hooks.REDUCER_STATE_ATTRIBUTE) for sub in restored.optimizer.optimizers)


class Shares(keras_hooks.StrategyHooks):
    """A tfdp strategy's answers about its split, without workers: `rows` of every batch, or None."""

    def __init__(self, rows):
        self.rows = rows

    is_chief = True
    reduce_step_outputs = check_batch_size = agree_on_inputs = all_have_data = extra_callbacks = training_step = None

    def rows_of_this_rank(self, global_rows):
        return self.rows


def build_stateful_lstm_under(monkeypatch, shares):
    import tensorflow as tf

    tfdp._compat.install()
    strategy = type("Strategy", (), {"extended": shares})()
    monkeypatch.setattr(tf.distribute, "has_strategy", lambda: True)
    monkeypatch.setattr(tf.distribute, "in_cross_replica_context", lambda: True)
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: strategy)
    layer = keras.layers.LSTM(3, stateful=True)
    layer.build((32, 5, 2))
    return layer


def test_a_stateful_rnn_keeps_the_state_of_its_workers_rows_only(monkeypatch):
    # The step of a worker whose share of a 32-row global batch is 12 rows sees 12 rows: its state
    # holds 12 (a hook that did nothing would leave 32, the batch of keras.Input).
    layer = build_stateful_lstm_under(monkeypatch, Shares(12))
    assert [tuple(state.shape) for state in layer.states] == [(12, 3), (12, 3)]


def test_a_stateful_rnn_under_balance_auto_is_refused_and_named(monkeypatch):
    with pytest.raises(ValueError, match=r'stateful.*balance="auto".*balance=\[\.\.\.\]'):
        build_stateful_lstm_under(monkeypatch, Shares(None))


def test_only_callbacks_whose_code_may_stop_training_are_agreed_on(tmp_path):
    import importlib.util

    from tfdp._compat.keras import BATCH_HOOKS, EPOCH_HOOKS, may_stop_training_at

    def load(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    header = "import time\nimport keras\n\nclass C(keras.callbacks.Callback):\n"
    timer = load("timer_callback", header + "    def on_train_batch_end(self, batch, logs=None):\n"
                                            "        self.last = time.time()\n").C()
    budget = load("budget_callback", header + "    def on_epoch_end(self, epoch, logs=None):\n"
                                              "        if time.time() > 0:\n"
                                              "            self.model.stop_training = True\n").C()
    interactive = keras.callbacks.LambdaCallback(on_batch_end=eval("lambda batch, logs: None"))
    keras_own = [keras.callbacks.EarlyStopping(), keras.callbacks.TerminateOnNaN(), keras.callbacks.History()]
    everything = [timer, budget, interactive, *keras_own]
    # A timer and Keras's own callbacks never set the flag; code that names it, or whose source
    # cannot be read (typed in a session), may.
    assert may_stop_training_at(everything, BATCH_HOOKS) == [interactive]
    assert may_stop_training_at(everything, EPOCH_HOOKS) == [budget]
    assert may_stop_training_at([timer, *keras_own], BATCH_HOOKS + EPOCH_HOOKS) == []
