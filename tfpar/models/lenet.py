"""LeNet exactly as in the from-scratch multi-GPU chapter.

conv 3x3x20 -> ReLU -> avg-pool 2/2 -> conv 5x5x50 -> ReLU -> avg-pool 2/2 -> flatten ->
dense 128 ReLU -> dense ``num_classes`` (logits).
"""

from __future__ import annotations

import keras
from keras import layers

from tfpar.models.arguments import check_builder_args


def lenet(num_classes: int = 10, input_shape: tuple[int, ...] = (28, 28, 1),
          name: str = "lenet") -> keras.Model:
    """Builds the reference LeNet.

    Args:
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``; at least 18x18 so both convolutions fit.
        name: Model name, also the prefix of every layer name.

    Returns:
        A functional Keras model mapping images to logits.

    Raises:
        ValueError: If ``num_classes`` or ``input_shape`` is invalid.
    """
    check_builder_args(num_classes, input_shape, min_size=18)
    inputs = keras.Input(shape=input_shape, name=f"{name}_input")
    x = layers.Conv2D(20, 3, activation="relu", name=f"{name}_conv1")(inputs)
    x = layers.AveragePooling2D(2, strides=2, name=f"{name}_pool1")(x)
    x = layers.Conv2D(50, 5, activation="relu", name=f"{name}_conv2")(x)
    x = layers.AveragePooling2D(2, strides=2, name=f"{name}_pool2")(x)
    x = layers.Flatten(name=f"{name}_flatten")(x)
    x = layers.Dense(128, activation="relu", name=f"{name}_dense1")(x)
    outputs = layers.Dense(num_classes, name=f"{name}_logits")(x)
    return keras.Model(inputs, outputs, name=name)
