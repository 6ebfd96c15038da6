"""A tiny compiled classifier that matches :func:`tfpar.testing.tiny_dataset`."""

from __future__ import annotations

import keras


def tiny_model(input_shape: tuple[int, int, int] = (18, 18, 1), num_classes: int = 3,
               lr: float = 0.1) -> keras.Model:
    """Returns a new Flatten + Dense classifier compiled with plain SGD and a logits loss.

    Call it inside a strategy's scope to build it there. Every call makes new variables and
    a new optimizer, as ``assertMatchesSingleDevice`` needs.

    Args:
        input_shape: Image shape.
        num_classes: Number of logits.
        lr: SGD learning rate.

    Returns:
        The compiled model.
    """
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(num_classes)])
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
