"""Train a digit classifier on scikit-learn's digits (8x8 images, 10 classes).

    python examples/digits.py                                          # one process
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py   # two workers
    TFDP_STRATEGY=topk-1pct horovodrun -np 2 ... python examples/digits.py   # another preset
    tfdp run -np 2 --strategy topk-1pct examples/digits.py             # the same, through tfdp

The only distributed-specific line is the strategy. ``batch_size`` is the global batch,
so the script trains the same way on any number of workers. The data and the conv net are
`tfdp.tools.workloads.load_digits_split` and `build_digits_model`, which `tfdp bench` and
the tests train too.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.tools.workloads import build_digits_model, load_digits_split  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)

    strategy = tfdp.strategy()  # the distributed line: $TFDP_STRATEGY, default "sync"
    with strategy.scope():
        model = build_digits_model(keras.optimizers.Adam(args.learning_rate))
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
