"""The models and data tfdp's example, `tfdp bench`, benchmarks and tests train, in one place.

- digits: scikit-learn's 8x8 digit images (ships with scikit-learn, works offline), a
  stratified 80/20 split, and a small conv net (or an MLP on the flattened pixels);
- breast_cancer: scikit-learn's 569 tumours with 30 features each (standardised on the
  training split), 2 classes, for an MLP;
- mlp: a 1024-h-h-10 MLP sized to a parameter count (communication-bound benchmarks);
- cnn: a 32x32x3 conv net of 315,722 parameters.

Example:
    >>> x_train, y_train, x_test, y_test = load_digits_split(seed=0)
    >>> model = build_digits_model(keras.optimizers.Adam(2e-3))
"""

import math

import keras
import numpy as np

CLASSES = 10
MLP_INPUT = 1024


def load_digits_split(seed=0, test_size=0.2):
    """Return (x_train, y_train, x_test, y_test): 8x8x1 images in [0, 1], int32 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


def load_breast_cancer_split(seed=0, test_size=0.2):
    """Return (x_train, y_train, x_test, y_test): 30 features standardised on the training rows."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    data = load_breast_cancer()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype("float32"), data.target.astype("int32"), test_size=test_size, random_state=seed,
        stratify=data.target)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


DATASETS = {"digits": load_digits_split, "breast_cancer": load_breast_cancer_split}


def build_classifier_mlp(input_shape, classes, optimizer, width=64):
    """A 2-hidden-layer MLP classifier (inputs flattened), compiled with `optimizer`."""
    model = keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(classes),
    ])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def build_digits_model(optimizer=None, learning_rate=2e-3):
    """The digits conv net, compiled with `optimizer` (default: Adam at `learning_rate`)."""
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def mlp_hidden_width(params):
    """Width h of an MLP 1024-h-h-10 with about `params` parameters."""
    # params = 1024 h + h + h^2 + h + 10 h + 10
    b = MLP_INPUT + 12
    return max(8, int((-b + math.sqrt(b * b + 4 * (params - CLASSES))) / 2))


def build_mlp(params):
    """An uncompiled 1024-h-h-10 MLP of about `params` parameters."""
    width = mlp_hidden_width(params)
    return keras.Sequential([
        keras.Input((MLP_INPUT,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def build_cnn(_params=None):
    """An uncompiled 32x32x3 conv net (315,722 parameters)."""
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


SYNTHETIC = {"mlp": build_mlp, "cnn": build_cnn}


def synthetic_data(model, rows, seed=0):
    """Random inputs of the model's shape and random labels (timing workloads)."""
    x = np.random.default_rng(seed).normal(size=(rows, *model.input_shape[1:])).astype("float32")
    y = np.random.default_rng(seed + 1).integers(0, CLASSES, size=rows)
    return x, y
