"""Callbacks that stop training on one rank only (a wall-clock budget, say): every rank stops
where that rank did. Prints, per case, a marker line, then the iterations trained and a
checksum of the weights."""

import sys

import keras
import numpy as np

import tfdp


class StopOnOneRank(keras.callbacks.Callback):
    """Stops training on `rank` at `batch` (of the first epoch), or after `epoch`."""

    def __init__(self, rank, batch=None, epoch=None):
        super().__init__()
        self.rank, self.batch, self.epoch = rank, batch, epoch

    def on_train_batch_end(self, batch, logs=None):
        if tfdp.rank() == self.rank and batch == self.batch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if tfdp.rank() == self.rank and epoch == self.epoch:
            self.model.stop_training = True


def main():
    strategy = tfdp.MirroredStrategy()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype("float32"), rng.normal(size=(128, 1)).astype("float32")

    def lambda_stop(model):
        def stop(batch, logs):
            if tfdp.rank() == 1 and batch == 1:
                model.stop_training = True
        return keras.callbacks.LambdaCallback(on_train_batch_end=stop)

    cases = {"batch on rank 1": lambda model: StopOnOneRank(1, batch=2),
             "epoch on rank 0": lambda model: StopOnOneRank(0, epoch=1),
             "lambda on rank 1": lambda_stop,
             "every rank": lambda model: StopOnOneRank(tfdp.rank(), batch=2)}
    for case, make_callback in cases.items():
        print(f"case: {case}", file=sys.stderr, flush=True)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[make_callback(model)])
        checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
        print(f"stopped: iterations={int(model.optimizer.iterations.numpy())} checksum={checksum!r}",
              file=sys.stderr, flush=True)
    print("case: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
