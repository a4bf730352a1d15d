"""What `shard_optimizer_state` refuses, on 2 workers: each rank prints one line per case.

    gradient accumulation    ValueError at fit
    a MultiOptimizer         ValueError at compile naming it (a callable selector: its config
                             cannot be rebuilt, which failed inside Keras before)
    Adafactor                ValueError at fit (factored moments are not one slot per entry;
                             one worker holds them whole, so it needs 2)
    saving by hand unsettled RuntimeError naming strategy.settle (a negative control: after
                             settling, the same save works)
"""

import tempfile

import keras
import numpy as np

import tfdp


def model_under(strategy, make_optimizer=None, **optimizer_options):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="first"), keras.layers.Dense(1)])
        optimizer = make_optimizer() if make_optimizer else keras.optimizers.Adam(1e-3, **optimizer_options)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def multi_optimizer():
    adam, sgd = keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.01)
    return keras.optimizers.MultiOptimizer(lambda variable: adam if "first" in variable.path else sgd)


def report(case, action):
    try:
        action()
        print(f"{case}: no error")
    except (ValueError, RuntimeError) as error:
        print(f"{case}: {type(error).__name__}: {error}")


def main():
    x, y = np.random.rand(64, 4).astype("float32"), np.random.rand(64, 1).astype("float32")
    strategy = tfdp.MirroredStrategy(shard_optimizer_state=True)
    accumulating = model_under(strategy, gradient_accumulation_steps=2)
    report("accumulation", lambda: accumulating.fit(x, y, batch_size=16, verbose=0))
    report("multi optimizer", lambda: model_under(strategy, multi_optimizer))
    report("adafactor", lambda: model_under(strategy, keras.optimizers.Adafactor).fit(x, y, batch_size=16, verbose=0))
    model = model_under(strategy)
    model.fit(x, y, batch_size=16, verbose=0)
    model.train_on_batch(x[:16], y[:16])
    path = tempfile.mkdtemp() + "/model.keras"
    report("unsettled save", lambda: model.save(path))
    strategy.settle(model.optimizer)
    report("settled save", lambda: model.save(path))


if __name__ == "__main__":
    main()
