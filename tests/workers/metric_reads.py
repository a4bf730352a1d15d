"""Read a fitted model's metrics the way Keras does at the end of an epoch, and reset them;
write the values and the collectives each took.

Every rank trains on the same global batches, but the metrics each rank holds are over its own
rows, so its local values differ from the global ones.
"""

import argparse

from _common import write_result

import keras
import numpy as np
import tensorflow as tf

import tfdp


class Count(keras.metrics.Metric):
    """Rows seen, in an int64 variable (a second dtype among the metric variables)."""

    def __init__(self, name="count"):
        super().__init__(name=name)
        self.rows = self.add_variable(shape=(), dtype="int64", initializer="zeros", aggregation="sum")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.rows.assign_add(tf.shape(y_true, out_type=tf.int64)[0])

    def result(self):
        return tf.convert_to_tensor(self.rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = tfdp.MirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True), Count()])
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)

    stats = strategy.extended.communicator.stats
    before = stats.as_dict()["collectives"]
    together = {k: float(v) for k, v in model.get_metrics_result().items()}
    after_together = stats.as_dict()["collectives"]
    one_by_one = {k: float(v) for k, v in type(model).get_metrics_result._tfdp_original(model).items()}
    after_one_by_one = stats.as_dict()["collectives"]
    model.reset_metrics()
    after_reset = stats.as_dict()["collectives"]
    local = [float(v.value.values[0].numpy()) for m in model.metrics for v in m.variables]
    write_result(args.out, {
        "together": together, "one_by_one": one_by_one,
        "epoch_logs": {k: v[-1] for k, v in history.history.items()},
        "metric_variables": sum(len(m.variables) for m in model.metrics),
        "collectives_together": after_together - before,
        "collectives_one_by_one": after_one_by_one - after_together,
        "collectives_reset": after_reset - after_one_by_one,
        "after_reset": local,
    })


if __name__ == "__main__":
    main()
