"""An embedding model trained with `fit` under tfdp, then by plain Keras in the same process.

Two tables, 10 global batches of 64 rows, 8 lookups per row: ``large`` has 100,000 rows
(a batch touches at most 512 of them, 0.5%), ``small`` 16 rows (every worker touches every
row in every batch: the dense path must win). Rank r writes rank<r>.json: per table the
communication statistics under tfdp; and rank<r>-<table>.npz: the final weights under tfdp
(``weights_<i>``) and those of plain Keras on the same global batches (``reference_<i>``: batch
64 on one worker, no strategy). NumPy files, not JSON: the large table is 1.6 M floats.
"""

import argparse
from pathlib import Path

import _common
import keras
import numpy as np

BATCH, STEPS, LOOKUPS, WIDTH = 64, 10, 8, 16


def data(rows):
    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, size=(BATCH * STEPS, LOOKUPS)).astype("int32")
    if rows <= LOOKUPS * BATCH // 2:  # every half batch (one worker's rows) looks up every row
        x = (np.arange(BATCH * STEPS * LOOKUPS).reshape(BATCH * STEPS, LOOKUPS) % rows).astype("int32")
    y = rng.normal(size=(BATCH * STEPS, 1)).astype("float32")
    return x, y


def train(rows, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else _nothing():
        model = keras.Sequential([keras.Input((LOOKUPS,), dtype="int32"), keras.layers.Embedding(rows, WIDTH),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    x, y = data(rows)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    stats = {} if strategy is None else {k: v for k, v in strategy.communication_stats().items()
                                         if isinstance(v, (int, float))}
    return {"weights": model.get_weights(), "stats": stats}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import tfdp

    stats = {}
    for name, rows in (("large", 100_000), ("small", 16)):
        trained = train(rows, tfdp.MirroredStrategy())
        reference = train(rows, None)["weights"]
        stats[name] = trained["stats"]
        np.savez(Path(args.out) / f"rank{_common.rank()}-{name}.npz",
                 **{f"weights_{i}": w for i, w in enumerate(trained["weights"])},
                 **{f"reference_{i}": w for i, w in enumerate(reference)})
    _common.write_result(args.out, stats)


if __name__ == "__main__":
    main()
