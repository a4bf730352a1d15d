"""A model built and trained outside the strategy's scope while a strategy of 2 workers exists:
tfdp warns once per model that each worker trains it alone. The model inside the scope and a
model with its own train_step (which may exchange what it likes) get no warning. Prints a marker
line before each case."""

import sys
import warnings

import keras
import numpy as np

import tfdp


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def main():
    warnings.simplefilter("always")  # every warning tfdp gives is shown, not only the first
    strategy = tfdp.MirroredStrategy()
    x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")

    def model(cls=keras.Sequential):
        built = cls([keras.Input((4,)), keras.layers.Dense(1)])
        built.compile(optimizer="sgd", loss="mse")
        return built

    with strategy.scope():
        inside = model()
    alone, own_step = model(), model(OwnStep)
    for case, trained in (("inside", inside), ("alone", alone), ("alone again", alone), ("own step", own_step)):
        print(f"case: {case}", file=sys.stderr, flush=True)
        trained.fit(x, y, batch_size=16, epochs=1, verbose=0)
    print("case: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
