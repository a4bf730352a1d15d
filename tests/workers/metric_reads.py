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


def traced_functions(fn, seen=None):
    """The `tf.function`s behind Keras's train function (tfdp and Keras wrap it in closures)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if hasattr(fn, "_list_all_concrete_functions"):
        return [fn]
    found = []
    for cell in getattr(fn, "__closure__", None) or []:
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if callable(inner):
            found += traced_functions(inner, seen)
    return found


def collectives_after_backprop(model, optimizer_scope):
    """For the step's logs exchange and its gradient exchanges: whether each waits for backprop
    (has a gradient op among the ops it depends on)."""
    waits = {"logs": [], "gradients": []}
    for function in traced_functions(model.train_function):
        for concrete in function._list_all_concrete_functions():
            for body in concrete.graph.as_graph_def().library.function:
                nodes = {node.name: node for node in body.node_def}
                if not any(name.startswith("gradient_tape/") for name in nodes):
                    continue  # a branch function (the uneven-rows exchange): its gradients are arguments
                for node in body.node_def:
                    if not node.op.startswith("Horovod"):
                        continue
                    ancestors, pending = set(), [node.name]
                    while pending:
                        name = pending.pop()
                        if name in ancestors or name not in nodes:
                            continue
                        ancestors.add(name)
                        pending += [i.lstrip("^").split(":")[0] for i in nodes[name].input]
                    kind = "gradients" if node.name.startswith(optimizer_scope + "/") else "logs"
                    waits[kind].append(any(a.startswith("gradient_tape/") for a in ancestors))
    return waits


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
        "collectives_waiting_for_backprop": collectives_after_backprop(model, model.optimizer.name),
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
