"""What `shard_optimizer_state` refuses, in one plain process: prints one line per case.

    gradient accumulation    ValueError at fit
    saving by hand unsettled RuntimeError naming strategy.settle (a negative control: after
                             settling, the same save works)
"""

import tempfile

import keras
import numpy as np

import tfdp


def model_under(strategy, **optimizer_options):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3, **optimizer_options), loss="mse")
    return model


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
    model = model_under(strategy)
    model.fit(x, y, batch_size=16, verbose=0)
    model.train_on_batch(x[:16], y[:16])
    path = tempfile.mkdtemp() + "/model.keras"
    report("unsettled save", lambda: model.save(path))
    strategy.settle(model.optimizer)
    report("settled save", lambda: model.save(path))


if __name__ == "__main__":
    main()
