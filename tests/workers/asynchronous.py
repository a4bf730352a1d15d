"""AsyncStrategy under horovodrun: delayed averaging, stale gradients, the staleness bound, local SGD.

Every case fits a small MLP with plain SGD on fixed data (no shuffle) and records the
weights, the stats and a timestamp after every batch. Rank 0 also computes a
single-process reference of the same algorithm with plain TensorFlow (no strategy):
per-worker steps swapped for their average s steps later for delayed averaging, delayed
full-batch gradients for stale gradients, per-worker local steps plus averaging for local SGD.
"""

import argparse
import time
from pathlib import Path

import _common
import keras
import numpy as np
import tensorflow as tf

import tfdp

STEPS = 12
OUT = None  # set from --out
BATCH = 32
LR = 0.1


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 20)).astype("float32")
    y = (x[:, :3] @ rng.normal(size=(3, 1))).astype("float32")
    return x, y


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


class Recorder(keras.callbacks.Callback):
    def __init__(self, delay=0.0):
        super().__init__()
        self.delay = delay
        self.times, self.checksums = [], []

    def on_train_batch_begin(self, batch, logs=None):
        if self.delay:
            time.sleep(self.delay)  # a slow worker

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.time())
        self.checksums.append(float(sum(np.abs(w).sum() for w in self.model.get_weights())))


def fit(strategy, delay=0.0, save_to=None, validate=False):
    x, y = data()
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    recorder = Recorder(delay)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder],
                        validation_data=validation_data() if validate else None)
    result = {"weights": [w.tolist() for w in model.get_weights()], "times": recorder.times,
              "checksums": recorder.checksums, "stats": strategy.communication_stats()}
    if validate:
        result["val_loss"] = float(history.history["val_loss"][-1])
    if save_to is not None:
        # The rest of the contract: global evaluate, in-order predict, save on rank 0.
        result["evaluate"] = float(model.evaluate(x, y, batch_size=BATCH, verbose=0))
        result["numpy_mse"] = float(np.mean((model.predict(x, batch_size=BATCH, verbose=0) - y) ** 2))
        result["predict_rows"] = int(model.predict(x[:50], batch_size=BATCH, verbose=0).shape[0])
        if strategy.is_chief:
            model.save(save_to)
    return result


def gradient(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, model.trainable_variables)


def reference_stale(staleness):
    """One process, full global batches: step t applies the gradient of step t - s."""
    x, y = data()
    model = mlp()
    pending = []
    for t in range(STEPS):
        batch = slice(t * BATCH, (t + 1) * BATCH)
        pending.append(gradient(model, x[batch], y[batch]))
        if len(pending) > staleness:
            for v, g in zip(model.trainable_variables, pending.pop(0)):
                v.assign_sub(LR * g)
    for grads in pending:  # fit's end applies what is still in flight
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(LR * g)
    return [w.tolist() for w in model.get_weights()]


def validation_data():
    x, y = data()
    return x[:BATCH * 2], y[:BATCH * 2] + 0.5


def own_step(model, x, y, rank, t, workers):
    """Worker `rank`'s SGD step on its half of global batch t (a full step on its rows)."""
    per_worker = BATCH // workers
    start = t * BATCH + rank * per_worker
    grads = gradient(model, x[start:start + per_worker], y[start:start + per_worker])
    steps = [-LR * g for g in grads]
    for v, step in zip(model.trainable_variables, steps):
        v.assign_add(step)
    return steps


def mse(weights, x, y):
    model = mlp()
    model.set_weights(weights)
    return float(np.mean((model(x).numpy() - y) ** 2))


def reference_validation_losses(staleness, workers=2):
    """Validation at the end of the epoch, before fit's end swaps in what is in flight: the loss
    of the workers' average model, and (what validation would report without averaging) the
    mean over the workers of each one's own model's loss on its half of the rows."""
    replicas, _ = delayed_averaging_replicas(staleness, workers)
    vx, vy = validation_data()
    weights = [r.get_weights() for r in replicas]
    mean = [np.mean(ws, axis=0) for ws in zip(*weights)]
    half = len(vx) // workers
    own = np.mean([mse(w, vx[r * half:(r + 1) * half], vy[r * half:(r + 1) * half]) for r, w in enumerate(weights)])
    return {"average": mse(mean, vx, vy), "own": float(own)}


def delayed_averaging_replicas(staleness, workers=2):
    """The workers' models after every step of one epoch, and the swap still to make for each
    step in flight."""
    x, y = data()
    replicas = [mlp() for _ in range(workers)]
    own = [[] for _ in range(workers)]

    def swap_oldest():
        oldest = [steps.pop(0) for steps in own]
        for model, mine in zip(replicas, oldest):
            for i, v in enumerate(model.trainable_variables):
                v.assign_add(tf.add_n([steps[i] for steps in oldest]) / workers - mine[i])

    for t in range(STEPS):
        for r, model in enumerate(replicas):
            own[r].append(own_step(model, x, y, r, t, workers))
        if t >= staleness:
            swap_oldest()
    return replicas, (swap_oldest, own)


def reference_delayed_averaging(staleness, workers=2):
    """Each worker takes its own step; s steps later the workers' average replaces it; fit's end
    swaps in what is in flight and averages the models."""
    replicas, (swap_oldest, own) = delayed_averaging_replicas(staleness, workers)
    while own[0]:
        swap_oldest()
    for vs in zip(*(m.trainable_variables for m in replicas)):
        mean = tf.add_n([tf.convert_to_tensor(v) for v in vs]) / workers
        for v in vs:
            v.assign(mean)
    return [w.tolist() for w in replicas[0].get_weights()]


def reference_local(sync_every, workers=2):
    """Each worker steps on its half of every global batch; weights averaged every H steps."""
    x, y = data()
    replicas = [mlp() for _ in range(workers)]
    for t in range(STEPS):
        for r, model in enumerate(replicas):
            own_step(model, x, y, r, t, workers)
        if (t + 1) % sync_every == 0 or t == STEPS - 1:
            for vs in zip(*(m.trainable_variables for m in replicas)):
                mean = tf.add_n([tf.convert_to_tensor(v) for v in vs]) / workers
                for v in vs:
                    v.assign(mean)
    return [w.tolist() for w in replicas[0].get_weights()]


CASES = {
    "sync": lambda: fit(tfdp.MirroredStrategy()),
    "s0": lambda: fit(tfdp.AsyncStrategy(staleness=0)),
    "s1": lambda: fit(tfdp.AsyncStrategy(staleness=1), save_to=OUT / "s1.keras"),
    "s2": lambda: fit(tfdp.AsyncStrategy(staleness=2)),
    "s2-validation": lambda: fit(tfdp.AsyncStrategy(staleness=2), validate=True),
    "stale-s0": lambda: fit(tfdp.AsyncStrategy(staleness=0, method="stale_gradients")),
    "stale-s1": lambda: fit(tfdp.AsyncStrategy(staleness=1, method="stale_gradients")),
    "stale-s2": lambda: fit(tfdp.AsyncStrategy(staleness=2, method="stale_gradients")),
    "h4": lambda: fit(tfdp.AsyncStrategy(sync_every=4), save_to=OUT / "h4.keras"),
    "h5": lambda: fit(tfdp.AsyncStrategy(sync_every=5)),
    # Rank 1 sleeps 0.15 s before each step: how far may rank 0 run ahead?
    "slow-s0": lambda: fit(tfdp.AsyncStrategy(staleness=0), delay=0.15 * tfdp.rank()),
    "slow-s2": lambda: fit(tfdp.AsyncStrategy(staleness=2), delay=0.15 * tfdp.rank()),
    "slow-s4": lambda: fit(tfdp.AsyncStrategy(staleness=4), delay=0.15 * tfdp.rank()),
}
REFERENCES = {
    "ref-s0": lambda: reference_delayed_averaging(0),
    "ref-s1": lambda: reference_delayed_averaging(1),
    "ref-s2": lambda: reference_delayed_averaging(2),
    "ref-s2-validation": lambda: reference_validation_losses(2),
    "ref-stale-s0": lambda: reference_stale(0),
    "ref-stale-s1": lambda: reference_stale(1),
    "ref-stale-s2": lambda: reference_stale(2),
    "ref-h4": lambda: reference_local(4),
    "ref-h5": lambda: reference_local(5),
}


def main():
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", default=sorted(CASES))
    args = parser.parse_args()
    OUT = Path(args.out)
    results = {case: CASES[case]() for case in args.cases}
    if tfdp.rank() == 0:
        results.update({name: make() for name, make in REFERENCES.items()})
    _common.write_result(args.out, results)


if __name__ == "__main__":
    main()
